"""Run `teacher-server` as a child process and know when it serves.

The server writes a ready file (endpoint, ports, pid) only after its model loaded and its port
answers, so callers never poll a port or parse logs. Leaving the context stops the server the way
an operator would: SIGTERM (drain), then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


class TeacherStartError(RuntimeError):
    """The teacher-server process exited or did not become ready in time; the message has its log."""


@contextmanager
def teacher_process(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    ready_timeout: float = 120.0,
    stop_grace: float = 30.0,
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """`python -m teacher_server --port 0 --ready-file F ARGS`; yields (process, ready info).

    ARGS may override --port (they come last). The process's output goes to `log` (a temporary
    file when not given, quoted in the error if start-up fails).
    """
    with tempfile.TemporaryDirectory(prefix="teacher-") as tmp:
        ready = Path(tmp) / "ready.json"
        log_path = Path(log) if log is not None else Path(tmp) / "teacher.log"
        out: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in the finally below
        proc = subprocess.Popen(
            [sys.executable, "-m", "teacher_server", "--port", "0", "--ready-file", str(ready), *args],
            cwd=cwd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + ready_timeout
            while not ready.exists():
                if proc.poll() is not None:
                    raise TeacherStartError(
                        f"teacher-server exited with code {proc.returncode}: {_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise TeacherStartError(
                        f"teacher-server not ready after {ready_timeout:g}s: {_tail(log_path)}")
                time.sleep(0.05)
            yield proc, json.loads(ready.read_text())
        finally:
            stop(proc, stop_grace)
            out.close()


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> int:
    """SIGTERM (the server drains), SIGKILL if it has not exited after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"
