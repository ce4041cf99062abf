"""Real teacher servers for tests: in a background event loop, or as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from teacher_server import ServerConfig, TeacherServer, launch

REPO = Path(__file__).resolve().parent.parent


class ServerThread:
    """A TeacherServer on its own event loop thread; `with ServerThread(cfg) as s: s.port`."""

    def __init__(self, config: ServerConfig, start_timeout: float = 60.0) -> None:
        self.config = config
        self.server: TeacherServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="test-server")
        self._start_timeout = start_timeout

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()

        async def start() -> TeacherServer:
            srv = TeacherServer(self.config)
            await srv.start()
            return srv

        self.server = self.call(start(), self._start_timeout)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                self.call(self.server.stop(5.0))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


@contextlib.contextmanager
def teacher_process(
    args: Sequence[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 60.0
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """A real `python -m teacher_server ARGS` on a free port; its log stays in `tmp_path`."""
    log = tmp_path / f"teacher-{time.monotonic_ns()}.log"
    with launch.teacher_process(args, env=env, cwd=REPO, log=log, ready_timeout=timeout, stop_grace=5.0) as started:
        yield started


def start_all(stack: contextlib.ExitStack, processes: Sequence[launch.TeacherProcess]) -> None:
    """Start `processes` together (all launched before any is waited for, so their model loads
    overlap) and wait until each is ready; `stack` cleans each one up on exit."""
    for p in processes:
        stack.callback(p.cleanup)
        p.launch()
    for p in processes:
        p.wait_ready()
