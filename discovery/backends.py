"""The registry backends, by address scheme: the one table a new backend is added to.

Why a table: an address (``etcd://h:2379``) names its backend, and several places need facts about
that backend before (or without) opening it: the address parser (is the scheme known, is a port
required), the flags and the autoscaler (does it keep shared state: loads, demand, a leader),
``open_registry`` (which class). Before this table each of them spelled out ``"etcd"``. Now a
second backend is its own module (a :class:`~discovery.base.Registry` subclass) plus one
:class:`Backend` entry here, or a :func:`register_backend` call from that module.

The registry classes are named by import path and imported on first use, so this module imports
nothing and the address parser stays at the bottom of the package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["BACKENDS", "Backend", "backend", "register_backend", "registry_class", "shared_forms"]


@dataclass(frozen=True)
class Backend:
    """One registry backend.

    ``registry``: ``"module:Class"`` of its :class:`~discovery.base.Registry`. ``default_port``:
    the port an address may leave out (None: every endpoint needs one). ``shared``: it keeps
    shared state (teachers' loads, students' demand, autoscaler records, leader elections); a
    static list does not. ``example``: an address for error messages.
    """

    scheme: str
    registry: str
    default_port: int | None
    shared: bool
    example: str

    @property
    def form(self) -> str:
        """``etcd://HOST:PORT[,HOST:PORT...] (e.g. ...)``: how error messages show the scheme."""
        return f"{self.scheme}://HOST:PORT[,HOST:PORT...] (e.g. {self.example})"


BACKENDS: dict[str, Backend] = {
    "etcd": Backend("etcd", "discovery.etcd:EtcdRegistry", 2379, True, "etcd://10.0.0.5:2379,10.0.0.6:2379"),
    "static": Backend(
        "static", "discovery.static:StaticRegistry", None, False, "static://127.0.0.1:9898,127.0.0.1:9899"
    ),
}


def register_backend(entry: Backend) -> None:
    """Add (or replace) a backend; call it from the backend's module."""
    BACKENDS[entry.scheme.lower()] = entry


def backend(scheme: str) -> Backend:
    """The backend of ``scheme`` (``"etcd"``); ``ValueError`` naming the known ones otherwise."""
    try:
        return BACKENDS[scheme.lower()]
    except KeyError:
        known = ", ".join(f"{s}://" for s in BACKENDS)
        raise ValueError(f"unknown registry scheme {scheme + '://'!r} (known: {known})") from None


def registry_class(scheme: str) -> Any:
    """The :class:`~discovery.base.Registry` subclass of ``scheme``, imported now."""
    module, _, name = backend(scheme).registry.partition(":")
    return getattr(importlib.import_module(module), name)


def shared_forms() -> str:
    """The address forms of the backends that keep shared state, for messages (``etcd://...``)."""
    return " or ".join(b.form for b in BACKENDS.values() if b.shared)
