"""SIGINT and SIGTERM for every command line of the mesh, in one place.

Why one helper: ``teacher-server``, ``distill top``, ``distill-autoscaler`` and ``python -m
discovery`` all end the same way (Ctrl-C or SIGTERM: stop cleanly, exit 0), and the details are
easy to get wrong in four copies:

* The handlers go on the event loop (``loop.add_signal_handler``), so a signal wakes the loop and
  never raises ``KeyboardInterrupt`` in the middle of a cleanup.
* Installing a handler replaces an *inherited* ``SIG_IGN``: a script's background job (``cmd &``)
  starts with SIGINT ignored, and the command must still stop at Ctrl-C sent to it by a supervisor.
* Leaving restores the default handling, so nothing lingers on a loop that runs other code later.

Two ways to react, both from one :class:`StopSignals`: wait for it (``await stop.wait()``: a
server that drains before it returns), or have it cancel a task (``cancel=task``: a loop of reads
that should stop wherever it is); :attr:`StopSignals.received` then tells a cancellation that came
from a signal (exit 0) from any other.

Lives in ``discovery`` because that is the lowest package ``teacher_server`` and ``distill`` both
import (next to :mod:`discovery.aio`, the other asyncio helpers they share).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence
from types import TracebackType

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT and SIGTERM on the running loop, for as long as it is installed.

    ``with StopSignals() as stop: ... await stop.wait()`` (or :meth:`install` / :meth:`uninstall`
    where a ``with`` block does not fit). ``cancel``: a task to cancel at each signal as well.
    ``required=False``: where handlers cannot be installed (not the main thread, or a platform
    without them), carry on without them instead of raising ``RuntimeError``.
    """

    def __init__(
        self,
        *,
        cancel: asyncio.Task[object] | None = None,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
        required: bool = True,
    ) -> None:
        self._cancel = cancel
        self._signals = tuple(signals)
        self._required = required
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handled: list[signal.Signals] = []
        self.received: signal.Signals | None = None
        """The first stop signal that arrived (None: none yet)."""

    def install(self) -> StopSignals:
        """Install the handlers on the running loop; returns self."""
        self._loop = asyncio.get_running_loop()
        for sig in self._signals:
            try:
                self._loop.add_signal_handler(sig, self._fire, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                if self._required:
                    self.uninstall()
                    raise
                continue
            self._handled.append(sig)
        return self

    def uninstall(self) -> None:
        """Remove the handlers (the default handling returns). Idempotent."""
        loop, handled, self._handled = self._loop, self._handled, []
        if loop is None or loop.is_closed():
            return
        for sig in handled:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)

    def _fire(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig
        self._event.set()
        if self._cancel is not None:
            self._cancel.cancel()  # again at a second signal: a lost cancellation gets another chance

    @property
    def stopped(self) -> bool:
        """True once a stop signal arrived."""
        return self.received is not None

    async def wait(self) -> None:
        """Return once a stop signal arrived."""
        await self._event.wait()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()
