"""Elastic example: the CV student trained by ``torchrun`` with several DDP ranks (gloo, CPU), each
rank distilling through its own reader from the same teacher pool. See README.md and ``train``.
"""
