"""Fault-injection suite: real teacher and etcd processes, killed, hung, slowed and cut mid-epoch.

Every scenario checks the user-facing promise (each batch exactly once, in order, with the
in-process model's outputs) and records the longest stall the training loop saw.
"""
