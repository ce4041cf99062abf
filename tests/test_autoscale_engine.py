"""The local autoscaler backend runs an engine behind its registrar: the template
`distill register --engine vllm --url http://127.0.0.1:{port} ... -- ENGINE --port {port}`, a real
etcd, and teacher-server's vLLM-protocol HTTP front as the engine (a real vLLM starts in a minute;
the engine-client tests run one). The controller starts the registrar, the registrar starts the
engine and registers it once /health and /v1/models answer, and that record is what makes the
teacher count as started; scaling down SIGTERMs the registrar, which withdraws the record, stops
its engine and exits 0.

Also here: how a registrar template is completed (its own flags before its `--`, none after), and
how a record is matched to the process that wrote it when it does not carry the backend's id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.procs import child_pids
from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill.autoscale import Controller, ControllerConfig, LocalBackend, PolicyConfig
from distill.autoscale.backends.children import Child, registered_id
from distill.autoscale.errors import BackendError
from tests.etcd_fixtures import REPO, arun, unique_service
from tests.hf_models import save_llama

pytestmark = pytest.mark.slow


def engine_template(model_dir: Path) -> list[str]:
    """What an operator writes after `distill-autoscaler ... --`: the registrar, then the engine."""
    return [
        "distill", "register", "--engine", "vllm", "--url", "http://127.0.0.1:{port}",
        "--registry", "{registry}", "--service", "{service}",
        "--ttl", "3", "--probe-interval", "0.2", "--drain-timeout", "3", "--stop-grace", "10",
        "--", sys.executable, "-m", "teacher_server", "--model", f"hf:{model_dir}", "--name", "llama",
        "--device", "cpu", "--port", "0", "--http-port", "{port}", "--log-level", "WARNING",
    ]  # fmt: skip


async def until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# A registrar and a teacher-server (torch, transformers) start, register, drain and stop: on busy
# cores that takes tens of seconds; the test checks what happens, not how fast.
@pytest.mark.timeout(240)
def test_autoscaler_starts_an_engine_with_its_registrar_and_scaling_down_withdraws_it(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    save_llama(model_dir)
    service = unique_service("engine")
    with LocalEtcd() as etcd:

        async def scenario() -> None:
            registry = open_registry(etcd.address, timeout=2.0)
            backend = LocalBackend(engine_template(model_dir), registry=etcd.address, service=service, grace=30,
                                   env={"PYTHONPATH": str(REPO)}, supervise_interval=0.1)  # fmt: skip
            policy = PolicyConfig(min_teachers=1, max_teachers=1, down_window=1.0)
            controller = Controller(registry, backend, policy, ControllerConfig(service, period=0.3, election_ttl=2))
            try:
                async with controller:
                    await until("the registrar started", lambda: len(backend.processes) == 1, 20)
                    ((iid, registrar_pid),) = backend.processes.items()
                    await until("the engine's record registered", lambda: iid in (controller.teachers or {}), 150)
                    record = controller.teachers[iid].record  # type: ignore[index]
                    port = int(record.endpoint.rsplit(":", 1)[1])
                    assert record.protocol == "vllm" and record.endpoint == f"127.0.0.1:{port}"
                    assert backend.argv(port=port, device="cpu", instance_id=iid)[:6] == [
                        backend.command[0], "register", "--engine", "vllm", "--url", f"http://127.0.0.1:{port}"]
                    state = await backend.observe(controller.teachers or {})
                    assert state.starting == () and state.managed is not None and iid in state.managed, state
                    (engine_pid,) = child_pids(registrar_pid)  # the registrar's engine, teacher-server
                    cmdline = await asyncio.to_thread(Path(f"/proc/{engine_pid}/cmdline").read_bytes)
                    assert b"teacher_server" in cmdline

                    # Students gone for good: --min 0 lets the pool go to zero after the down window.
                    controller.policy = dataclasses.replace(controller.policy, min_teachers=0)
                    await until("scaled down", lambda: not backend.processes, 30)
                    downs = [d for d in controller.decisions if d.action == "down"]
                    assert downs and downs[-1].desired == 0, [d.reason for d in controller.decisions]
                    await until("the record withdrawn", lambda: iid not in (controller.teachers or {}), 30)
                    await until("the registrar drained and exited", lambda: iid in backend.stopped, 60)
                    assert backend.stopped[iid] == 0, "SIGTERM drains the registrar; it was not killed"
                    assert backend.crashes == 0 and backend.spawned == 1
                    await until("the engine stopped", lambda: not _alive(engine_pid), 10)
            finally:
                await registry.close()
            assert not backend.processes and not backend.draining

        arun(scenario(), timeout=230)


def test_a_registrar_template_gets_its_flags_before_its_own_separator() -> None:
    b = LocalBackend(
        ["distill", "register", "--engine", "vllm", "--url", "http://127.0.0.1:{port}", "--",
         "env", "CUDA_VISIBLE_DEVICES={gpu}", "vllm", "serve", "M", "--port", "{port}"],
        registry="etcd://h:1", service="svc", devices=["cuda:0", "cuda:3"],
    )  # fmt: skip
    argv = b.argv(port=7, device="cuda:3", instance_id="svc-1")
    split = argv.index("--")
    assert argv[1:split] == ["register", "--engine", "vllm", "--url", "http://127.0.0.1:7",
                             "--instance-id", "svc-1", "--registry", "etcd://h:1", "--service", "svc"]  # fmt: skip
    assert argv[split + 1 :] == ["env", "CUDA_VISIBLE_DEVICES=3", "vllm", "serve", "M", "--port", "7"]
    assert Path(argv[0]).name == "distill"  # found on PATH or beside this interpreter
    assert b.argv(port=7, device="cpu", instance_id="i")[-6] == "CUDA_VISIBLE_DEVICES="  # no GPU on cpu
    # What the template sets is left alone; only what it lacks is added.
    own = LocalBackend(["distill", "register", "--registry={registry}", "--service", "{service}", "--instance-id",
                        "x-{port}", "--url", "http://127.0.0.1:{port}", "--", "engine", "{port}"],
                       registry="etcd://h:1", service="svc")  # fmt: skip
    assert own.argv(port=9, device="cpu", instance_id="i")[2:] == [
        "--registry=etcd://h:1", "--service", "svc", "--instance-id", "x-9", "--url", "http://127.0.0.1:9", "--",
        "engine", "9"]  # fmt: skip


# A wrapper that ignores SIGTERM, with a child of its own in its process group that ignores it too.
_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"])
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for whoever reaps here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_a_wrapper_that_ignores_sigterm_is_killed_with_its_process_group_after_the_grace() -> None:
    async def scenario() -> None:
        backend = LocalBackend([sys.executable, "-c", _STUBBORN, "--", "engine", "{port}"], registry="etcd://h:1",
                               service="stubborn", grace=1.0, supervise_interval=0.05)  # fmt: skip
        await backend.start()
        try:
            await backend.scale(1, {})
            ((iid, pid),) = backend.processes.items()
            await until("the wrapper's own child started", lambda: bool(child_pids(pid)), 20)
            (grandchild,) = child_pids(pid)
            await backend.scale(0, {})
            assert backend.draining == {iid: pid}
            await until("SIGKILL after the grace", lambda: iid in backend.stopped, 10)
            assert backend.stopped[iid] == -9 and not backend.draining
            await until("its group killed with it", lambda: not _running(grandchild), 5)
        finally:
            await backend.close()

    arun(scenario(), timeout=40)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["distill", "register", "--engine", "vllm", "--url", "http://127.0.0.1:8000", "--", "vllm", "serve", "M"],
         "must place {port}"),
        (["distill", "register", "--url", "http://127.0.0.1:{port}", "--"], "ends with '--'"),
        (["distill", "register", "--url", "http://127.0.0.1:{port}", "--", "vllm", "--x", "{gpus}"],
         "unknown placeholder {gpus}"),
    ],
)  # fmt: skip
def test_bad_registrar_templates_are_refused_at_start(command: list[str], message: str) -> None:
    with pytest.raises(BackendError, match=message):
        LocalBackend(command, registry="etcd://127.0.0.1:2379", service="s")


@dataclasses.dataclass
class _Entry:
    endpoint: str


def test_a_record_is_matched_by_its_id_else_by_the_childs_loopback_port(tmp_path: Path) -> None:
    """A registrar that names its records itself is still recognised: by the port the backend gave
    its child, on a loopback address (a teacher elsewhere with the same port is not it)."""
    child = Child("svc-1", "cpu", 8123, proc=None, log_path=tmp_path / "log", started_at=0.0)  # type: ignore[arg-type]
    teachers: dict[str, Any] = {"svc-1": _Entry("10.0.0.5:1"), "other": _Entry("127.0.0.1:8123")}
    assert registered_id(child, teachers, "127.0.0.1") == "svc-1"
    for endpoint in ("127.0.0.1:8123", "[::1]:8123", "http://localhost:8123/v1", "0.0.0.0:8123"):
        assert registered_id(child, {"svc-engine-x": _Entry(endpoint)}, "127.0.0.1") == "svc-engine-x", endpoint
    for endpoint in ("10.0.0.5:8123", "127.0.0.1:8124", "127.0.0.1", "garbage"):
        assert registered_id(child, {"x": _Entry(endpoint)}, "127.0.0.1") is None, endpoint
    assert registered_id(child, {"x": _Entry("10.0.0.5:8123")}, "10.0.0.5") == "x"  # the backend's own host
