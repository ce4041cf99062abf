"""The engine as the registrar's child (``distill register ... -- ENGINE COMMAND``).

Why a parent at all: where nothing else supervises the engine (a bare VM, the local autoscaler
backend), one process that starts the engine, registers it while it is healthy and stops it in
order (withdraw, drain, SIGTERM, SIGKILL) is simpler to run than two that must agree. The engine
gets its own process group (a multi-process engine, vLLM with tensor parallelism, is stopped
whole) and the kernel's parent-death signal (it cannot outlive a SIGKILLed registrar).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from teacher_server import launch

__all__ = ["EngineChild", "engine_argv"]

log = logging.getLogger(__name__)


def engine_argv(command: Sequence[str], port: int) -> list[str]:
    """The command with ``{port}`` replaced by the engine's port (the port of ``--url``), so one
    template serves every replica the autoscaler starts. Other braces are left alone."""
    return [arg.replace("{port}", str(port)) for arg in command]


class EngineChild:
    """One engine process in its own process group; its output goes where the registrar's goes."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the engine (fork and exec only: safe on the event loop)."""
        log.info("starting the engine: %s", " ".join(self.argv))
        try:
            self._proc = launch.spawn(self.argv, log=None, new_session=True, pdeathsig=True)
        except OSError as e:
            raise FileNotFoundError(f"cannot start the engine command {self.argv[0]!r} ({e.strerror or e}); "
                                    "check the command after --") from None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def returncode(self) -> int | None:
        """The engine's exit status once it exited (reaped without blocking); None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, grace: float) -> int | None:
        """SIGTERM to the engine's group, SIGKILL to the group after ``grace`` seconds; its status."""
        if self._proc is None:
            return None
        if self.returncode() is None:
            log.info("stopping the engine (SIGTERM, SIGKILL after %g s)", grace)
            self._signal_group(signal.SIGTERM)
            if not await self._wait(grace):
                log.warning("the engine did not exit within %g s of SIGTERM; sending SIGKILL", grace)
        self._signal_group(signal.SIGKILL)  # whatever the engine left behind in its group
        await self._wait(10.0)
        return self.returncode()

    async def _wait(self, seconds: float) -> bool:
        """Poll (off nothing: poll() does not block) until the engine exits, at most ``seconds``."""
        end = time.monotonic() + seconds
        while self.returncode() is None:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return True
