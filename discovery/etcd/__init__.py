"""The etcd backend: lease-bound registrations and snapshot watches on top of ``aetcd``.

Why etcd: leases give us liveness for free (a teacher that dies without a word disappears when its
lease expires), watches give sub-second propagation, and revisions let a watcher that lost its
stream resume exactly where it stopped instead of re-reading everything.

The package, one concern per module:

* :mod:`~discovery.etcd.client`: :class:`EtcdClient` (TLS, IPv6, authentication; ``aetcd`` 1.0
  has no TLS of its own) and :class:`EtcdConnection` (one shared client, failover to the next
  endpoint in order, a deadline on every call).
* :mod:`~discovery.etcd.lease`: :class:`LeaseSession`, one lease's whole life like Go's
  ``concurrency.Session``: grant, keep alive every ``ttl/3``, notice loss, revoke on close.
* :mod:`~discovery.etcd.registration`: teachers' records and students' demand kept under a lease
  session, written again after an outage, re-registered after the lease is lost.
* :mod:`~discovery.etcd.election`: :class:`LeaderElection` (a :class:`~discovery.election.Election`),
  one active autoscaler per service, also a lease session's user.
* :mod:`~discovery.etcd.watch`: etcd's event stream as full snapshots (resume from the last
  revision, reload after compaction, periodic re-sync).
* :mod:`~discovery.etcd.view`: the whole ``/distill/v1/`` tree in one read, grouped into a
  :class:`~discovery.view.MeshView` (``distill top``).
* :mod:`~discovery.etcd.registry`: :class:`EtcdRegistry`, the :class:`~discovery.base.Registry`
  facade over all of it.
"""

from __future__ import annotations

from discovery.etcd.client import EtcdClient, EtcdConnection
from discovery.etcd.election import ElectionError, LeaderElection, leader_key
from discovery.etcd.lease import LeaseLostError, LeaseSession
from discovery.etcd.registry import EtcdRegistry

__all__ = [
    "ElectionError",
    "EtcdClient",
    "EtcdConnection",
    "EtcdRegistry",
    "LeaderElection",
    "LeaseLostError",
    "LeaseSession",
    "leader_key",
]
