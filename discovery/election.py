"""The leader-election interface: one active holder of a role (one autoscaler per service).

Why an interface: the autoscaler's controller needs "campaign, lead, notice the loss, publish
under my leadership, resign", not etcd's leases and transactions. A registry backend that keeps
shared state hands one out from :meth:`discovery.base.Registry.election`; the etcd one is
:class:`discovery.etcd.election.LeaderElection`. A backend without shared state (a static teacher
list) raises :class:`~discovery.errors.ElectionError` instead.

Contract every implementation keeps:

* :attr:`is_leader` is True only while leadership is *certain* (the backend's lease or term is
  known to be alive): past that, someone else may lead, so it turns False even before we hear of it.
* :meth:`campaign` never raises because the registry is unreachable; it retries until it leads or
  is cancelled. ``on_follow(holder)`` runs when another identity is seen leading.
* :meth:`publish` writes a record bound to the leadership: it disappears when leadership ends.
* Use from one event loop; :meth:`close` resigns.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

__all__ = ["Election"]


class Election(abc.ABC):
    """Campaign for, hold and give up one service's leadership; see the module docstring."""

    service: str
    identity: str
    terms: int  # how many times this candidate became leader (tests, metrics)
    polls: int  # looks at the current leader while campaigning (tests, metrics)

    @property
    @abc.abstractmethod
    def is_leader(self) -> bool:
        """True while we certainly lead."""

    @abc.abstractmethod
    async def campaign(self, on_follow: Callable[[str], Awaitable[None]] | None = None) -> None:
        """Wait until we lead (retrying through registry outages); cancel it to stop campaigning."""

    @abc.abstractmethod
    async def wait_lost(self) -> None:
        """Return once leadership is lost (at once if we do not lead)."""

    @abc.abstractmethod
    async def leader(self) -> str | None:
        """The identity leading now (one read), None when nobody leads."""

    @abc.abstractmethod
    async def publish(self, name: str, value: bytes) -> bool:
        """Keep ``value`` as the service's autoscaler record ``name`` for as long as we lead
        (``distill top`` shows these); False, writing nothing, when we do not lead."""

    @abc.abstractmethod
    async def resign(self) -> None:
        """Give up leadership now, so that a waiting candidate takes over at once. Idempotent."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Resign and refuse further campaigns."""
