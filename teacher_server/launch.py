"""Run `teacher-server` as a child process and know when it serves: the one launcher.

The examples, the benchmarks, the tests and the local autoscaler backend all start teachers
through this module, so start-up, logging and shutdown behave the same everywhere:

* `spawn` is the bottom layer: a teacher command (any argv) with its output in a log file (never
  a pipe, which a chatty server could fill and block on), optionally in its own session and with
  `PR_SET_PDEATHSIG` so that it cannot outlive a parent that was SIGKILLed. The local autoscaler
  backend uses it directly: its command is an operator's template and readiness is registration.
* `TeacherProcess` runs `python -m teacher_server` with a ready file. The server writes it (endpoint,
  ports, pid) only after its model loaded and its port answers, so callers never poll a port or
  parse logs. `launch()` and `wait_ready()` are split so that several servers can load at once
  (`start_all`).
* `teacher_process` is the context-manager form; leaving it stops the server the way an operator
  would: SIGTERM (drain), then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

__all__ = [
    "TeacherProcess",
    "TeacherStartError",
    "log_tail",
    "pdeathsig_argv",
    "spawn",
    "start_all",
    "stop",
    "teacher_process",
]


class TeacherStartError(RuntimeError):
    """The teacher-server process exited or did not become ready in time; the message has its log."""


# A tiny shim that asks the kernel to SIGTERM the real command when its parent dies, then execs
# it. `-S` skips site, so it costs ~10 ms. PR_SET_PDEATHSIG = 1; the getppid check closes the race
# of a parent that died before the prctl.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,int(signal.SIGTERM),0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def pdeathsig_argv(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that the process gets SIGTERM if its parent dies (Linux only).

    `finally:` clauses stop children on errors, Ctrl-C and SIGTERM, but not on SIGKILL or an OOM
    kill; the kernel can. The signal fires when the *thread* that spawned the child exits, so spawn
    from a thread that lives as long as the parent (the main thread, or an event loop's thread).
    Elsewhere the command is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def spawn(
    argv: Sequence[str],
    *,
    log: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    pdeathsig: bool = False,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `argv` with stdin from /dev/null and stdout+stderr to the file `log` (None: inherited).

    `env` is added to this process's environment. `new_session` keeps Ctrl-C away from the child,
    so its parent can stop it in order (drain) instead; `pdeathsig` see `pdeathsig_argv`. Popen
    forks and execs without waiting on the child: milliseconds, safe on an event loop.
    """
    command = pdeathsig_argv(argv) if pdeathsig else list(argv)
    full_env = {**os.environ, **(env or {})}
    if log is None:
        return subprocess.Popen(command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                start_new_session=new_session)
    with open(log, "wb") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=new_session)


def stop(proc: subprocess.Popen[Any], grace: float = 30.0, sig: int = signal.SIGTERM) -> int:
    """`sig` (SIGTERM: the server drains), SIGKILL if it has not exited after `grace` seconds.

    Idempotent and safe in `finally:`: a process that already exited is only reaped.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return int(proc.wait())


def log_tail(path: str | os.PathLike[str], lines: int = 30) -> str:
    """The last `lines` lines of a child's log, for error messages."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class TeacherProcess:
    """`python -m teacher_server --port 0 ARGS --ready-file F`, ready when F appears.

    ARGS may override `--port` (they come after it). `env` is added to this process's environment.
    The output goes to `log` (a file in a temporary directory when None, quoted in errors), or to
    this process's own stdout/stderr with `inherit_output`. Use as a context manager, or
    `launch()` + `wait_ready()` and `cleanup()`: the server is stopped (SIGTERM, which drains, then
    SIGKILL after `stop_grace` s) whatever happened, KeyboardInterrupt included.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        label: str = "teacher",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        inherit_output: bool = False,
        ready_timeout: float = 120.0,
        stop_grace: float = 30.0,
        python: str = sys.executable,
        pdeathsig: bool = False,
    ) -> None:
        self.args = list(args)
        self.label = label
        self.env = dict(env or {})
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.python = python
        self.pdeathsig = pdeathsig
        self.inherit_output = inherit_output
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{label}-")
        self.ready_file = Path(self._tmp.name) / "ready.json"
        self.log_path = Path(log) if log is not None else Path(self._tmp.name) / "teacher.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.exit_code: int | None = None
        self._deadline = 0.0

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "teacher_server", "--port", "0", *self.args, "--ready-file", str(self.ready_file)]

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.label} was not launched")
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        """host:port to dial, from the ready file."""
        return str(self.ready["endpoint"])

    def launch(self) -> None:
        """Spawn the process without waiting for it; `wait_ready()` does the rest of `start()`."""
        self.proc = spawn(self.command, log=None if self.inherit_output else self.log_path, env=self.env,
                          cwd=self.cwd, pdeathsig=self.pdeathsig)
        self._deadline = time.monotonic() + self.ready_timeout

    def wait_ready(self) -> TeacherProcess:
        """Until the ready file appears; stops the process and raises `TeacherStartError` with the
        log's tail if it exits first or `ready_timeout` passes."""
        if self.proc is None:
            raise RuntimeError("wait_ready() before launch()")
        while not self.ready_file.exists():
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise TeacherStartError(f"{self.label} (teacher-server) exited with code {code} before serving:"
                                        f"\n{self._log_for_error()}")
            if time.monotonic() > self._deadline:
                self.stop()
                raise TeacherStartError(f"{self.label} (teacher-server) not ready after {self.ready_timeout:g} s:"
                                        f"\n{self._log_for_error()}")
            time.sleep(0.05)
        self.ready = json.loads(self.ready_file.read_text(encoding="utf-8"))
        return self

    def start(self) -> TeacherProcess:
        """`launch()` and `wait_ready()`."""
        self.launch()
        return self.wait_ready()

    def kill(self) -> None:
        """SIGKILL now, no drain: what a crashed host or an OOM kill looks like to students.

        stop() / cleanup() afterwards only reap the process (its exit code is then -9).
        """
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def stop(self) -> int | None:
        """SIGTERM (drain), wait, SIGKILL if it hangs; idempotent. Returns the exit code."""
        if self.proc is not None:
            self.exit_code = stop(self.proc, self.stop_grace)
        return self.exit_code

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def _log_for_error(self) -> str:
        return "(its output went to this process's terminal)" if self.inherit_output else self.log_tail()

    def cleanup(self) -> None:
        """Stop the process and remove its temporary directory (ready file, default log)."""
        try:
            self.stop()
        finally:
            self._tmp.cleanup()

    def __enter__(self) -> TeacherProcess:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def start_all(stack: contextlib.ExitStack, servers: Sequence[TeacherProcess]) -> list[TeacherProcess]:
    """Start several servers at once and hand each one's cleanup to `stack`.

    All are launched before any is waited for, so their start-up (imports, model load) overlaps,
    which on a small machine halves the set-up time. The cleanups are registered first, so an
    error or Ctrl-C while any server is still starting stops every one of them when `stack` unwinds.
    """
    for server in servers:
        stack.callback(server.cleanup)
    for server in servers:
        server.launch()
    for server in servers:
        server.wait_ready()
    return list(servers)


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

    The context-manager form of `TeacherProcess`: ARGS may override --port; the output goes to
    `log` (a temporary file when not given, quoted in the error if start-up fails).
    """
    with TeacherProcess(args, env=env, cwd=cwd, log=log, ready_timeout=ready_timeout,
                        stop_grace=stop_grace) as server:
        assert server.proc is not None
        yield server.proc, server.ready
