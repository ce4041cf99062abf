"""What the controller needs from a backend: observe the pool, resize it, let it go."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

__all__ = ["Backend", "BackendState"]


@dataclass(frozen=True)
class BackendState:
    """The pool as the backend knows it.

    Attributes:
        current: managed teachers the backend runs or was last asked to run (its target; teachers
            being drained away are not counted).
        starting: start times (``time.monotonic()``) of managed teachers that have not registered
            yet; the policy counts them as capacity until ``start_timeout``.
        managed: instance ids of the teachers the backend started, or None when it cannot tell
            (then every registered teacher counts as managed).
        detail: a short description for logs (``"3 processes, 1 draining"``).
    """

    current: int
    starting: tuple[float, ...] = ()
    managed: frozenset[str] | None = None
    detail: str = ""


class Backend(abc.ABC):
    """Starts and stops teachers. Methods are called from the controller's event loop only and must
    not block it. ``teachers`` arguments are the latest registry snapshot (``instance_id ->
    TeacherEntry``), so a backend can tell which teachers registered and how loaded they are."""

    name: str = "backend"

    @property
    def limit(self) -> int | None:
        """The most teachers this backend can run (free accelerator slots), None when unbounded."""
        return None

    @abc.abstractmethod
    async def start(self) -> None:
        """Check the configuration and connect; raise :class:`~distill.autoscale.errors.BackendError`
        with an actionable message when the backend cannot work at all."""

    @abc.abstractmethod
    async def observe(self, teachers: Mapping[str, object]) -> BackendState:
        """The pool now. May raise :class:`~distill.autoscale.errors.BackendUnavailableError`."""

    @abc.abstractmethod
    async def scale(self, desired: int, teachers: Mapping[str, object]) -> None:
        """Make the pool ``desired`` managed teachers. May raise ``BackendUnavailableError``."""

    async def stand_down(self) -> None:  # noqa: B027 - an optional hook, empty on purpose
        """Leadership was lost: stop managing. Default: nothing (a shared object such as a
        Deployment is the new leader's to manage); backends that own processes release them."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything this backend holds. Idempotent."""

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
