"""`teacher-server` refuses bad flags and files before the model loads (issue #13, CLI).

Each case checks: a non-zero exit within the run's time limit (a server that starts serving
instead would hit it), one error line naming the flag, the value and the fix, no traceback, and
that no model was loaded (no "loading" line). A refusal's message is printed or logged by the
command's entry point whether it runs as a process or not, so the cases refused before anything
serves run that entry point in the test process; the real command (a process, its log on its
stderr) runs for one printed refusal (an unknown device), for the logged ones (a port in use),
and for the etcd credentials, whose check may time out and then serve.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from discovery.local_etcd import LocalEtcd
from discovery.options import PASSWORD_ENV
from teacher_server.launch import TeacherProcess
from tests.certs import make_certs
from tests.etcd_fixtures import enable_root_auth
from tests.servers import REPO

# The thread method: a case run in this process that served instead of refusing would wait in the
# server's event loop, which the signal method cannot interrupt; this ends the run with the stacks.
pytestmark = pytest.mark.timeout(120, method="thread")

MODEL = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1"]
RUN_LIMIT_S = 60.0  # a refusal takes about a second (imports); serving would run into this


def _refused(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run teacher-server ARGS to its exit; (exit code, its output, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "teacher_server", *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_LIMIT_S,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    seconds = time.monotonic() - start
    return proc.returncode, proc.stdout + proc.stderr, seconds


Run = Callable[[list[str], "dict[str, str] | None"], tuple[int, str, float]]


@pytest.fixture
def in_process(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Iterator[Run]:
    """teacher-server's entry point run in this process, as `_refused` runs the command: (exit
    code, what it printed and logged at INFO and above, seconds). Torch's thread count, which a
    server start sets, is put back after."""
    from teacher_server.cli import main

    threads = torch.get_num_threads()
    caplog.set_level(logging.INFO)

    def run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
        caplog.clear()
        capsys.readouterr()  # what this test printed before: not the command's output
        start = time.monotonic()
        with pytest.MonkeyPatch.context() as mp:  # `env` for this run only, as for a process
            for name, value in (env or {}).items():
                mp.setenv(name, value)
            try:
                code = main(args)
            except SystemExit as e:  # argparse's own refusals
                code = e.code if isinstance(e.code, int) else 1
        seconds = time.monotonic() - start
        said = capsys.readouterr()
        return code, said.out + said.err + caplog.text, seconds

    yield run
    torch.set_num_threads(threads)


def _check_refusal(args: list[str], *words: str, env: dict[str, str] | None = None, run: Run | None = None) -> str:
    """Run ARGS (as a process, or with `run`), check it is refused as the module says, with `words`
    in the error line; that line."""
    code, out, seconds = (run or _refused)(args, env)
    lines = [line for line in out.splitlines() if line.strip()]
    print(f"{' '.join(args[-4:])}: exit {code} after {seconds:.1f} s: {lines[-1] if lines else ''}")
    assert code != 0, out
    assert "Traceback" not in out, out
    assert "loading" not in out and "serving" not in out, f"refused only after loading the model:\n{out}"
    assert "draining" not in out and "WARNING" not in out, f"a refusal with warnings beside it:\n{out}"
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, f"want one error line:\n{out}"
    for w in words:
        assert w in errors[0], f"{w!r} missing from {errors[0]!r}"
    return errors[0]


def test_unknown_device_is_refused() -> None:
    _check_refusal([*MODEL, "--device", "banana"], "--device", "banana", "use cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_refused(in_process: Run) -> None:
    _check_refusal([*MODEL, "--device", "cuda:0"], "--device cuda:0", "CUDA is not available", "--device cpu",
                   run=in_process)


@pytest.mark.parametrize("ttl", ["-1", "0", "nan"])
def test_bad_ttl_is_refused_before_loading(ttl: str, in_process: Run) -> None:
    _check_refusal([*MODEL, "--registry", "etcd://127.0.0.1:1", "--service", "s", "--ttl", ttl],
                   "--ttl", ttl, "positive number of seconds", run=in_process)


@pytest.mark.parametrize(("flag", "value"), [("--threads", "-2"), ("--drain-grace", "-1"),
                                             ("--metrics-port", "70000"), ("--model-config", "/nonexistent.json")])
def test_other_bad_values_are_refused(flag: str, value: str, in_process: Run) -> None:
    _check_refusal([*MODEL, flag, value], flag, value, run=in_process)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_metrics_port_in_use_names_the_port(busy_port: int) -> None:
    _check_refusal([*MODEL, "--metrics-port", str(busy_port)], f"--metrics-port {busy_port}", "--metrics-port 0")


def test_grpc_port_in_use_names_the_port(busy_port: int) -> None:
    _check_refusal([*MODEL, "--port", str(busy_port)], f"--port {busy_port}", "--port 0")


def test_tls_key_of_another_certificate_is_refused(tmp_path: Path, in_process: Run) -> None:
    certs = make_certs(tmp_path).dir
    cert, key = str(certs / "server.pem"), str(certs / "client.key")
    line = _check_refusal([*MODEL, "--tls-cert", cert, "--tls-key", key], "--tls-key", key, "does not match",
                          cert, run=in_process)
    assert "port" not in line


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("auth-etcd")) as server:
        enable_root_auth(server)
        yield server


def test_wrong_etcd_password_is_fatal(auth_etcd: LocalEtcd) -> None:
    """Processes: a registry check that gets no answer in time is not a refusal, and the server then
    serves; a process runs into its time limit there, where the entry point in this process would
    serve until a signal."""
    registry = [*MODEL, "--registry", auth_etcd.address, "--service", "auth-svc", "--registry-user", "root"]
    _check_refusal(registry, "--registry", "root", "authentication failed", PASSWORD_ENV,
                   env={PASSWORD_ENV: "wrong"})
    _check_refusal(registry[:-2], "--registry", "--registry-user")  # auth enabled, no user given


def test_right_etcd_password_serves(auth_etcd: LocalEtcd) -> None:
    args = [*MODEL, "--registry", auth_etcd.address, "--service", "auth-svc", "--registry-user", "root"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO), PASSWORD_ENV: "rootpw"},
                        ready_timeout=60, stop_grace=10) as t:
        assert t.ready["endpoint"]
    assert t.exit_code == 0
