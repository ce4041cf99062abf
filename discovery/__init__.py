"""Discovery: how students find teachers, and how teachers say they exist.

Teachers are spare GPUs that come and go; students must use a new teacher within about a second and
stop using a dead one without waiting for anyone to clean up. So teachers announce themselves in
etcd under keys bound to a *lease*: as long as the teacher lives, it keeps the lease alive; when it
dies (even by SIGKILL), etcd deletes its keys after the lease TTL. Students *watch* the service's
keys and always act on a full, current snapshot of the live teachers. When nothing dynamic is
needed, a fixed ``static://host:port,...`` list gives students the same interface.

Entry points::

    registry = open_registry("etcd://10.0.0.5:2379")          # or "static://h1:9898,h2:9898"
    async with registry.register("svc", record, load=load_fn):  # teacher side
        ...
    async for snapshot in registry.watch("svc"):               # student side
        ...                                                    # TeacherSet: id -> TeacherEntry

Operators and the autoscaler read the whole mesh with ``registry.view()`` (``distill top``, in
:mod:`discovery.top`) and hold leadership with ``registry.election(service, identity=...)``. Backends
by address scheme: :mod:`discovery.backends` (a new one is a module plus an entry there).

Key layout: :mod:`discovery.keys`. Choosing a per-student subset of teachers: :func:`subset`.
A real etcd for tests and demos: :class:`discovery.local_etcd.LocalEtcd`.
"""

from __future__ import annotations

from typing import Any

from discovery.address import Endpoint, RegistryAddress, parse_address, parse_registry_address
from discovery.backends import registry_class
from discovery.base import (
    Registration,
    Registry,
    TeacherEntry,
    TeacherSet,
    TeacherWatch,
)
from discovery.election import Election
from discovery.errors import ElectionError, RegistryError, RegistryUnavailableError, RegistryUnsupportedError
from discovery.etcd import EtcdRegistry
from discovery.static import StaticRegistry
from discovery.subset import subset
from discovery.view import MeshView

__all__ = [
    "Election",
    "ElectionError",
    "Endpoint",
    "EtcdRegistry",
    "MeshView",
    "Registration",
    "Registry",
    "RegistryAddress",
    "RegistryError",
    "RegistryUnavailableError",
    "RegistryUnsupportedError",
    "StaticRegistry",
    "TeacherEntry",
    "TeacherSet",
    "TeacherWatch",
    "open_registry",
    "parse_address",
    "parse_registry_address",
    "subset",
]


def open_registry(address: str | RegistryAddress, **etcd_options: Any) -> Registry:
    """The registry an address names, by its scheme (:mod:`discovery.backends`): ``etcd://`` gives
    an :class:`EtcdRegistry` (``etcd_options`` are passed to it: ``ca_cert``, ``username``,
    ``timeout``, ...), ``static://`` a :class:`StaticRegistry` (which has no options; any given are
    ignored; its items may name engines, ``static://vllm://HOST:PORT,HOST:PORT``). Raises
    ``ValueError`` for a malformed address, with the accepted forms in the message."""
    if isinstance(address, str) and address.strip().lower().startswith("static://"):
        return StaticRegistry(address)
    parsed = address if isinstance(address, RegistryAddress) else parse_address(address)
    registry: Registry = registry_class(parsed.scheme).from_address(parsed, **etcd_options)
    return registry
