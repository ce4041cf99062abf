"""A real Triton for the tests and benchmarks: PyTriton (`nvidia-pytriton`) in its own cached virtualenv.

PyTriton ships the real Triton core (tritonserver, its Python backend and a backend stub per
Python version) in a manylinux wheel, and runs it on CPU. It pins numpy<2, so it must stay out of
the project's environment: `pytriton_venv()` builds a separate virtualenv once, from the same
interpreter as the running one (the backend stub must match its Python version), and caches it
under `<cache>/pytriton-venv-<hash>` where the hash covers the pinned requirements and the
interpreter. The build happens in a temporary directory that is renamed into place only when pip
succeeded, so a crashed or killed build is never reused, and under a file lock, so two pytest
processes do not build it at once. `cached_venv()` says whether it is built already, for a
benchmark that compares with PyTriton whenever it can without a two-minute build.

`pytriton_server()` starts `benchmarks/pytriton_server.py` from that venv on free loopback ports,
waits (bounded) until Triton has loaded the model, and stops it on exit: SIGTERM, then SIGKILL of
its whole process group (tritonserver and the backend stubs are its children), both bounded.
With `torch_model` it serves a torch module of the project (W2/W3's RefTeacher) with the
project's own torch, which the venv does not hold: the project's root and the directory torch is
installed in go on the server's `sys.path` after the venv's own packages.

The backend stub links `libpython3.X.so.1.0`; it must be the running interpreter's own, not
whatever libpython the system's loader finds first (Debian ships one of another patch release,
a CI image may ship none), so the server runs with `LD_LIBRARY_PATH` starting with this
interpreter's `sysconfig.get_config_var("LIBDIR")`.

This lives in benchmarks/ so the benchmarks can use it; the tests import it from here too
(`tests/pytriton_env.py` re-exports it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.procs import child_pids
from examples.common import cache_dir

REPO = Path(__file__).resolve().parent.parent
SERVER_SCRIPT = Path(__file__).resolve().parent / "pytriton_server.py"

# What the venv holds: PyTriton and the numpy it accepts. No torch: the served model is numpy.
REQUIREMENTS: tuple[str, ...] = ("nvidia-pytriton==0.7.0", "numpy<2")
# The wheel is manylinux_2_35_x86_64 and carries backend stubs for these Python versions.
_MIN_GLIBC = (2, 35)
_STUB_VERSIONS = {(3, 8), (3, 9), (3, 10), (3, 11), (3, 12), (3, 13)}

BUILD_TIMEOUT_S = 900.0  # pip downloads ~60 MB and installs ~370 MB; about 2 min on a 2-core machine
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

# Triton expects the restriction header on gRPC with this prefix before the configured key.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class PyTritonUnavailable(RuntimeError):
    """This host cannot run PyTriton's Triton (platform, interpreter); the message says why and what would fix it."""


class PyTritonError(RuntimeError):
    """Building the PyTriton venv or starting its server failed; the message carries the log's tail."""


def libpython_dir() -> Path:
    """The directory holding this interpreter's shared libpython, for the backend stub's loader."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not libdir or not (Path(libdir) / soname).exists():
        raise PyTritonUnavailable(
            f"this Python ({sys.executable}) has no shared libpython ({soname} in {libdir}); Triton's Python "
            "backend stub needs one. Use an interpreter built with --enable-shared (python.org, Debian, "
            "actions/setup-python and pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared all are)."
        )
    return Path(libdir)


def check_platform() -> None:
    """Raise PyTritonUnavailable, saying why, where the PyTriton wheel cannot run."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise PyTritonUnavailable(f"nvidia-pytriton 0.7.0 ships Linux x86_64 wheels only; this is "
                                  f"{sys.platform}/{platform.machine()}")
    libc, version = platform.libc_ver()
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) if version else ()
    if libc != "glibc" or len(parts) < 2 or parts < _MIN_GLIBC:
        raise PyTritonUnavailable(f"nvidia-pytriton 0.7.0 needs glibc >= 2.35 (manylinux_2_35); this host has "
                                  f"{libc or 'no glibc'} {version}")
    if sys.version_info[:2] not in _STUB_VERSIONS:
        raise PyTritonUnavailable(f"nvidia-pytriton 0.7.0 has backend stubs for Python 3.8-3.13, not "
                                  f"{sys.version_info[0]}.{sys.version_info[1]}")
    libpython_dir()


def venv_path(requirements: Sequence[str] = REQUIREMENTS) -> Path:
    """The cached venv's path: one per requirement set and interpreter (a venv is bound to its Python)."""
    key = json.dumps({"requirements": list(requirements), "python": sys.version,
                      "base": getattr(sys, "_base_executable", sys.executable)}, sort_keys=True)
    return cache_dir() / f"pytriton-venv-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on `path`, waited for at most `timeout` seconds (another process building)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PyTritonError(f"another process has held {path} for {timeout:.0f} s (a PyTriton venv "
                                        "build); wait for it or remove the lock file if no build runs") from None
                time.sleep(0.5)  # polling a lock another process holds; bounded by the deadline above
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-chars:]


def cached_venv(requirements: Sequence[str] = REQUIREMENTS) -> Path | None:
    """The PyTriton venv if this host can run it and it is built already; None otherwise (nothing is built)."""
    try:
        check_platform()
    except PyTritonUnavailable:
        return None
    final = venv_path(requirements)
    return final if _python(final).exists() else None


def pytriton_venv(requirements: Sequence[str] = REQUIREMENTS, timeout: float = BUILD_TIMEOUT_S) -> Path:
    """The PyTriton venv, built now if it is not cached yet; returns its directory.

    Raises PyTritonUnavailable where PyTriton cannot run here, PyTritonError when pip fails.
    """
    check_platform()
    final = venv_path(requirements)
    if _python(final).exists():
        return final
    with _file_lock(final.with_name(final.name + ".lock"), timeout):
        if _python(final).exists():  # built by another process while we waited
            return final
        for stale in final.parent.glob(final.name + ".tmp-*"):  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        log = final.with_name(final.name + ".build.log")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        deadline = time.monotonic() + timeout
        try:
            with log.open("w") as out:
                for cmd in (
                    [sys.executable, "-m", "venv", str(tmp)],
                    [str(_python(tmp)), "-m", "pip", "install", "--disable-pip-version-check",
                     "--no-input", "--progress-bar", "off", *requirements],
                ):
                    out.write(f"$ {' '.join(cmd)}\n")
                    out.flush()
                    remaining = deadline - time.monotonic()
                    try:
                        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=True,
                                       timeout=max(remaining, 1.0), cwd=final.parent)
                    except subprocess.TimeoutExpired:
                        raise PyTritonError(f"building the PyTriton venv took over {timeout:.0f} s; see {log}:\n"
                                            f"{_tail(log)}") from None
                    except subprocess.CalledProcessError as e:
                        raise PyTritonError(f"building the PyTriton venv failed ({' '.join(cmd[:4])}... exited "
                                            f"{e.returncode}); see {log}:\n{_tail(log)}") from None
            # Nothing in bin/ but the interpreter is used, so the scripts' shebangs naming `tmp` do not matter.
            tmp.chmod(0o755)  # mkdtemp made it private; the final venv is readable like any cache entry
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@dataclass(frozen=True)
class Restriction:
    """An access restriction Triton enforces: calls to `endpoints` need header `header` = `value`."""

    endpoints: tuple[str, ...]
    header: str  # as HTTP sees it
    value: str

    @property
    def grpc_header(self) -> str:
        """The name gRPC calls must carry (Triton prefixes the configured key on gRPC)."""
        return GRPC_HEADER_PREFIX + self.header

    def grpc_metadata(self) -> dict[str, str]:
        return {self.grpc_header: self.value}


@dataclass(frozen=True)
class PyTritonServer:
    """A running PyTriton server: where it listens, what it serves, and its log."""

    process: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    model: str
    dim: int
    classes: int
    max_batch_size: int
    restriction: Restriction | None
    log: Path
    workspace: Path  # PyTriton's model store and sockets; removed when the server stops
    input_shape: tuple[int, ...] = ()  # INPUT without the batch dimension
    instances: int = 1

    def pids(self) -> list[int]:
        """The server's whole process tree (this script, tritonserver, the backend stubs): the
        processes whose CPU time is the server's."""
        found: list[int] = []
        todo = [self.process.pid]
        while todo and len(found) < 1000:  # bounded: a process tree is far smaller
            pid = todo.pop()
            found.append(pid)
            todo.extend(c for c in child_pids(pid) if c not in found)
        return sorted(found)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


def torch_site() -> Path:
    """The directory the running interpreter imports torch from (its site-packages)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise PyTritonError("torch is not installed in this environment; a torch model served by PyTriton uses "
                            "the project's own torch: run from the project's virtualenv (make venv)")
    return Path(spec.origin).resolve().parent.parent


def _server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra or {})
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(libpython_dir()) + (f":{previous}" if previous else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_ready(proc: subprocess.Popen[bytes], fd: int, timeout: float) -> dict[str, Any] | None:
    """The server's ready line from pipe `fd`; None when it exited (or closed the pipe) first."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        readable, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            data += chunk
        elif proc.poll() is not None:
            return None
    ready: dict[str, Any] = json.loads(data.split(b"\n", 1)[0])
    return ready


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server (it stops Triton itself), then SIGKILL its process group; both bounded."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left of the group this server leads (tritonserver, backend stubs) goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextlib.contextmanager
def pytriton_server(
    *,
    model: str = "linear",
    dim: int = 16,
    classes: int = 10,
    max_batch_size: int = 64,
    max_queue_delay_us: int | None = None,
    torch_model: str | None = None,
    input_shape: Sequence[int] | None = None,
    instances: int = 1,
    threads: int = 0,
    env: Mapping[str, str] | None = None,
    restrict: str = "none",
    access_token: str | None = None,
    log_dir: Path | None = None,
    venv: Path | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
    stop_timeout: float = STOP_TIMEOUT_S,
    attempts: int = 3,
) -> Iterator[PyTritonServer]:
    """A PyTriton server serving `LOGITS = INPUT @ weights(dim, classes)` until the block ends.

    `torch_model` ("MODULE:FN", e.g. "examples.refteacher:build") serves that torch module instead,
    INPUT [-1, *input_shape], with `instances` model instances and `threads` torch threads (0:
    torch's default). `max_queue_delay_us` is the dynamic batcher's (None: the script's default);
    `env` is added to the server's environment. `restrict`: "none", "default" (PyTriton's own
    default restriction) or endpoint groups, as `benchmarks/pytriton_server.py --restrict` takes.
    Ports are free loopback ports chosen by the server; a start that loses a port to another process
    is retried (at most `attempts` starts).
    """
    python = _python(venv or pytriton_venv())
    server_env = _server_env(env)
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), str(SERVER_SCRIPT), "--model", model, "--dim", str(dim), "--classes", str(classes),
           "--max-batch-size", str(max_batch_size), "--restrict", restrict]
    if access_token is not None:
        cmd += ["--access-token", access_token]
    if max_queue_delay_us is not None:
        cmd += ["--max-queue-delay-us", str(max_queue_delay_us)]
    cmd += ["--instances", str(instances), "--threads", str(threads)]
    if torch_model is not None:
        cmd += ["--torch-model", torch_model, "--import-path", str(REPO), "--import-path", str(torch_site())]
        if input_shape is not None:
            cmd += ["--input-shape", ",".join(str(d) for d in input_shape)]
    for attempt in range(1, attempts + 1):
        log = log_dir / f"pytriton-{model}-{os.getpid()}-{time.monotonic_ns()}.log"
        # A short workspace path: PyTriton puts unix sockets there (108-byte limit on their paths).
        workspace = Path(tempfile.mkdtemp(prefix="pyt-"))
        read_fd, write_fd = os.pipe()
        try:
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [*cmd, "--ready-fd", str(write_fd), "--workspace", str(workspace / "ws")],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=server_env, cwd=workspace,
                    pass_fds=(write_fd,), start_new_session=True,
                )
            os.close(write_fd)
            write_fd = -1
            try:
                try:
                    ready = _wait_ready(proc, read_fd, ready_timeout)
                except TimeoutError:
                    raise PyTritonError(f"PyTriton was not ready within {ready_timeout:.0f} s; log {log}:\n"
                                        f"{_tail(log)}") from None
                if ready is None:
                    _stop(proc, stop_timeout)
                    text = _tail(log)
                    if attempt < attempts and "already in use" in text.lower():
                        continue  # a port we picked was taken before Triton bound it
                    raise PyTritonError(f"PyTriton exited ({proc.returncode}) before it was ready; log {log}:\n{text}")
                r = ready.get("restriction")
                yield PyTritonServer(
                    process=proc, grpc_port=int(ready["grpc_port"]), http_port=int(ready["http_port"]),
                    model=str(ready["model"]), dim=int(ready["dim"]), classes=int(ready["classes"]),
                    max_batch_size=int(ready["max_batch_size"]),
                    restriction=Restriction(tuple(r["endpoints"]), str(r["header"]), str(r["value"])) if r else None,
                    log=log, workspace=workspace, input_shape=tuple(int(d) for d in ready["input_shape"]),
                    instances=int(ready["instances"]),
                )
                return
            finally:
                _stop(proc, stop_timeout)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            shutil.rmtree(workspace, ignore_errors=True)
    raise PyTritonError(f"PyTriton did not start in {attempts} attempts")  # pragma: no cover - loop returns or raises
