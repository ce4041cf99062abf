"""The Python-first API (`teacher_server.serve` / `start` / `prepare`), `--model-path`, and the
torch.export hint: real servers on 127.0.0.1, called with tritonclient; registration in a real etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from torch import nn

import teacher_server
from benchmarks.cpu import thread_cpu_seconds
from benchmarks.pinning import on_cores
from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from teacher_server.api import RegistryAccessError, prepare, server_config
from teacher_server.cli import apply_model_path, build_parser, config_from_args
from teacher_server.launch import TeacherProcess
from teacher_server.model import LoadedModel, ModelLoadError, load_model
from teacher_server.server import ServerConfig, TeacherServer
from teacher_server.spec import ModelIO, SpecError, TensorSpec
from tests.etcd_fixtures import arun, enable_root_auth, unique_service
from tests.models import Affine
from tests.servers import REPO, teacher_process

SCRIPT = """
import sys
import torch
from torch import nn
import teacher_server

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(32.0).reshape(4, 8) / 10)
            self.lin.bias.fill_(1.0)

    def forward(self, x):
        return {"LOGITS": self.lin(x), "HIDDEN": x * 2}

ready, registry, service = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
code = teacher_server.serve(
    Net(), name="pyteacher", inputs=["X:FP32:8"], port=0, device="cpu", instances=1,
    preprocess=lambda x: x + 1,                  # per batch, on the instance thread
    postprocess=lambda out: out["LOGITS"],       # pick one output
    registry=registry, service=service, ttl=5, ready_file=ready)
print("serve returned", code, flush=True)
sys.exit(code)
"""


def _expected(x: np.ndarray) -> np.ndarray:
    w = np.arange(32.0, dtype=np.float32).reshape(4, 8) / 10
    return (x + 1) @ w.T + 1.0


class _PythonServer(TeacherProcess):
    """A user's script calling teacher_server.serve(); ready when its ready file appears."""

    def __init__(self, script: Path, *extra: str, log: Path) -> None:
        super().__init__([], label="python-serve", cwd=REPO, log=log, ready_timeout=60.0, stop_grace=10.0,
                         env={"PYTHONPATH": str(REPO)})
        self.script, self.extra = script, extra

    @property
    def command(self) -> list[str]:
        return [self.python, str(self.script), str(self.ready_file), *self.extra]


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def _infer(endpoint: str, x: np.ndarray, model: str = "pyteacher") -> dict[str, np.ndarray]:
    with tg.InferenceServerClient(endpoint) as c:
        inp = tg.InferInput("X", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer(model, [inp], client_timeout=30.0)
        meta = c.get_model_metadata(model, as_json=True)
        return {o["name"]: res.as_numpy(o["name"]) for o in meta["outputs"]}


def test_serve_an_nn_module_from_python_registers_and_drains(tmp_path: Path, etcd: LocalEtcd) -> None:
    script = tmp_path / "serve_it.py"
    script.write_text(SCRIPT)
    service = unique_service("pyserve")
    server = _PythonServer(script, etcd.address, service, log=tmp_path / "serve.log")
    with server:
        x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
        outs = _infer(server.endpoint, x)
        assert list(outs) == ["OUTPUT0"], "postprocess picked one output; its name is inferred"
        np.testing.assert_allclose(outs["OUTPUT0"], _expected(x), rtol=1e-5, atol=1e-4)

        async def registered() -> list[str]:
            async with open_registry(etcd.address) as reg:
                return [t.endpoint for t in (await reg.teachers(service)).values()]

        assert arun(registered()) == [server.endpoint]
        code = server.stop()
    assert code == 0, server.log_tail()
    assert "serve returned 0" in server.log_tail()
    assert arun(registered()) == [], "the lease is revoked on the way out"


def test_start_from_async_code_runs_the_warm_up_and_stops(tmp_path: Path) -> None:
    async def main() -> np.ndarray:
        server = await teacher_server.start(Affine(), name="affine", port=0, device="cpu", instances=1,
                                            max_batch_size=16)
        try:
            assert server.config.batching.max_batch_size == 16
            x = np.ones((3, 8), dtype=np.float32)
            return (await asyncio.to_thread(_infer, server.endpoint, x, "affine"))["Y"]
        finally:
            await server.stop()

    y = arun(main(), 60)
    expected = Affine()(torch.ones(3, 8)).detach().numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_prepare_checks_like_the_cli() -> None:
    config, loaded = prepare(nn.Linear(8, 3), inputs=["X:FP32:8"], device="cpu", instances=1)
    assert loaded.io == ModelIO.parse(["X:FP32:8"], ["OUTPUT0:FP32:3"])  # inferred by the warm-up forward
    assert config.model == "<python Linear>"
    with pytest.raises(ModelLoadError, match="warm-up batch"):
        prepare(nn.Linear(8, 3), inputs=["X:FP32:5"], device="cpu")
    with pytest.raises(SpecError, match="declares no inputs"):
        prepare(nn.Linear(8, 3), device="cpu")
    with pytest.raises(SpecError, match=r"unknown option\(s\) max_batch"):
        prepare(nn.Linear(8, 3), inputs=["X:FP32:8"], max_batch=4)
    with pytest.raises(SpecError, match="takes a list"):
        prepare(nn.Linear(8, 3), inputs="X:FP32:8")
    with pytest.raises(SpecError, match="need the model itself"):
        prepare("tests.models:affine", postprocess=lambda y: y)
    with pytest.raises(SpecError, match="service= needs registry"):
        teacher_server.serve(nn.Linear(8, 3), inputs=["X:FP32:8"], service="s")


def _user_module(tmp_path: Path) -> str:
    name = f"user_teacher_{uuid.uuid4().hex[:8]}"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"{name}.py").write_text(textwrap.dedent("""
        from torch import nn
        from teacher_server import ModelIO

        def build():
            net = nn.Linear(8, 2)
            net.io_spec = ModelIO.parse(["X:FP32:8"])
            return net
    """))
    return name


def test_model_path_imports_the_factory_from_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from teacher_server.cli import main

    name = _user_module(tmp_path)
    args = ["--model", f"{name}:build", "--name", "user", "--device", "cpu", "--instances", "1"]
    # Without --model-path the import fails before anything serves: the entry point in this process
    # (its sys.path restored afterwards), from the checkout as `python -m teacher_server` would run.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)
    code = main(args)
    said = capsys.readouterr().err + caplog.text
    assert code == 2 and "--model-path DIR" in said, said
    with teacher_process([*args, "--model-path", str(tmp_path / "models")], tmp_path) as (_proc, info):
        out = _infer(info["endpoint"], np.zeros((2, 8), dtype=np.float32), "user")
        assert out["OUTPUT0"].shape == (2, 2)


def test_model_path_defaults_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    assert apply_model_path(argparse.Namespace(model_path=[])) == [str(tmp_path.resolve())]
    assert sys.path[0] == str(tmp_path.resolve())
    with pytest.raises(SpecError, match="is not a directory"):
        apply_model_path(argparse.Namespace(model_path=[str(tmp_path / "nope")]))


def test_pt2_with_a_fixed_batch_says_how_to_export_it(tmp_path: Path) -> None:
    static = tmp_path / "static.pt2"
    torch.export.save(torch.export.export(Affine(), (torch.zeros(4, 8),)), str(static))
    with pytest.raises(ModelLoadError, match=r"fixed batch size of 4.*dynamic_shapes=\{'x': \{0: batch\}\}"):
        load_model(str(static), device="cpu", io=Affine.io_spec)
    dynamic = tmp_path / "dynamic.pt2"
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(Affine(), (torch.zeros(4, 8),), dynamic_shapes={"x": {0: batch}}),
                      str(dynamic))
    assert load_model(str(dynamic), device="cpu", io=Affine.io_spec).io.outputs[0].shape == (4,)


def test_a_hand_built_server_warms_its_model_up_before_serving() -> None:
    """TeacherServer(ServerConfig(...), model=LoadedModel(...)) gets the warm-up a loaded model gets:
    a model that fails on its declared inputs is refused in start(), and undeclared outputs are
    inferred before the first request."""
    cpu = torch.device("cpu")

    async def main() -> np.ndarray:
        wrong = LoadedModel(nn.Linear(8, 3), ModelIO.parse(["X:FP32:5"]), cpu)  # declared 5, needs 8
        refused = TeacherServer(ServerConfig(model="<hand-built>", name="lin", port=0), wrong)
        with pytest.raises(ModelLoadError, match="warm-up batch"):
            await refused.start()
        await refused.stop(0)
        net = nn.Linear(8, 3).eval()
        server = TeacherServer(ServerConfig(model="<hand-built>", name="lin", port=0),
                               LoadedModel(net, ModelIO.parse(["X:FP32:8"]), cpu))
        await server.start()
        try:
            assert server.io.outputs == (TensorSpec("OUTPUT0", "FP32", (3,)),), "inferred by the warm-up"
            x = np.ones((2, 8), dtype=np.float32)
            return (await asyncio.to_thread(_infer, server.endpoint, x, "lin"))["OUTPUT0"]
        finally:
            await server.stop()

    y = arun(main(), 60)
    assert y.shape == (2, 3)


def test_the_cli_builds_the_config_serve_builds() -> None:
    """`teacher-server FLAGS` and `serve(model, **options)` give one ServerConfig: the CLI only maps
    flags onto the API's options (no second copy of the defaults or the batching setup)."""
    flags = ["--model", "tests.models:affine", "--name", "aff", "--version", "3", "--device", "cpu",
             "--input", "X:FP32:8", "--output", "Y:FP32:4", "--max-batch-size", "32", "--max-queue-delay-us",
             "900", "--max-queue-size", "64", "--top-k", "2", "--temperature", "2.0", "--http-port", "0",
             "--drain-grace", "5", "--model-arg", "seed=3", "--port", "0"]
    from_cli = config_from_args(build_parser().parse_args(flags))
    from_api = server_config("tests.models:affine", name="aff", version="3", device="cpu", inputs=["X:FP32:8"],
                             outputs=["Y:FP32:4"], max_batch_size=32, max_queue_delay_us=900, max_queue_size=64,
                             top_k=2, temperature=2.0, http_port=0, drain_grace_s=5.0, model_args={"seed": 3})
    assert from_cli == from_api
    defaults = config_from_args(build_parser().parse_args(["--model", "tests.models:affine", "--device", "cpu"]))
    assert defaults == server_config("tests.models:affine", device="cpu", port=8001)  # serve()'s port, too
    assert defaults.instances >= 1 and defaults.batching.max_batch_size == 256


def test_serve_refuses_credentials_etcd_refuses_before_serving(tmp_path: Path) -> None:
    """serve() makes the CLI's registry check: a refused etcd user stops it with RegistryAccessError
    (not a teacher serving unregistered while registration retries forever); the model is never
    warmed up, let alone served."""
    warmed: list[int] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        warmed.append(len(x))
        return x * 2

    with LocalEtcd(tmp_path / "auth-etcd") as auth_etcd:
        enable_root_auth(auth_etcd)
        with pytest.raises(RegistryAccessError, match="refused user root") as e:
            teacher_server.serve(model, inputs=["X:FP32:4"], port=0, device="cpu", instances=1,
                                 registry=auth_etcd.address, service=unique_service("auth"),
                                 registry_options={"username": "root", "password": "wrong"})
    assert e.value.user == "root" and "authentication failed" in e.value.said
    assert warmed == [], "refused before the warm-up"


def test_the_instance_default_follows_the_device_named_even_without_that_device_here() -> None:
    from teacher_server.server import GPU_INSTANCES, default_instances

    assert default_instances("cpu") == len(os.sched_getaffinity(0))
    assert default_instances("cuda") == default_instances("cuda:1") == GPU_INSTANCES == 2


def test_a_teacher_pinned_to_one_core_runs_one_instance_with_one_thread(tmp_path: Path) -> None:
    """The CPU defaults count the cores the process may run on (a cpuset, `taskset`, a pod's
    exclusive CPUs), not the host's: pinned to one core, the server runs one single-threaded
    instance, where the host's count would start one per host core, all on that one."""
    core = min(os.sched_getaffinity(0))
    args = ["--model", "examples.refteacher:build", "--name", "ref", "--device", "cpu"]
    log = tmp_path / "teacher.log"
    proc = TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, log=log, ready_timeout=120, stop_grace=10)
    with on_cores([core]):  # a child starts with the affinity of the thread that forks it
        proc.launch()
    try:
        proc.wait_ready()
        assert os.sched_getaffinity(proc.pid) == {core}
        assert ", 1 instance(s)," in log.read_text(), log.read_text()
        client = tg.InferenceServerClient(proc.endpoint)
        try:
            x = tg.InferInput("INPUT", [4, 3, 32, 32], "FP32")
            x.set_data_from_numpy(np.ones((4, 3, 32, 32), dtype=np.float32))
            assert client.infer("ref", [x]).as_numpy("LOGITS").shape == (4, 100)
        finally:
            client.close()
        # After a batch ran: one instance thread and no OpenMP worker beside it (a worker would carry
        # the name of the instance thread that started it).
        names = [name for name, _ in thread_cpu_seconds(proc.pid).values()]
        assert sorted(n for n in names if n.startswith("instance-")) == ["instance-0"]
    finally:
        proc.stop()
