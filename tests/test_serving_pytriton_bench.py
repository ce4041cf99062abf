"""benchmarks.serving (W2/W3) end to end at its smallest, PyTriton side included: PyTriton (the real
Triton core, from its own cached virtualenv) serves RefTeacher beside teacher-server, driven by the
same load generator; every figure is sane, and the W2/W3 ratios against PyTriton land in the JSON
and the table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import serving
from tests.bench_runs import machine_recorded, positive, run_benchmark_main
from tests.pytriton_env import pytriton_python_or_skip

# The venv may be built here first (pip download and install, about 2 minutes once).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def pytriton_python() -> Path:
    return pytriton_python_or_skip()


def test_the_benchmark_measures_the_servers_and_pytriton_beside_them(pytriton_python: Path, tmp_path: Path) -> None:
    # One repetition, no quiet gate (--max-foreign-cores 0): a smoke run. Windows of 2 s: a batch of
    # 256 takes a few hundred ms on a busy 2-core machine, and a window that saw fewer than two
    # bursts of answers would say 0 samples/s. One model instance of one torch thread per server
    # (and in the in-process loops): each window keeps one core busy, not two, and the batch-256
    # requests run one after the other, each its own burst. With two cores or more, the servers and
    # the in-process loops run on the last and the load generator on the first (--server-cpus,
    # --client-cpus). Its main in this process (a fresh interpreter would import torch again); the
    # servers are processes of their own either way.
    cores = sorted(os.sched_getaffinity(0))
    split = ["--server-cpus", str(cores[-1]), "--client-cpus", str(cores[0])] if len(cores) > 1 else []
    doc = run_benchmark_main(serving.main, ["--quick", "--pytriton", "--reps", "1", "--warmup", "0.3", "--duration",
                                            "2", "--instances", "1", "--threads", "1", "--max-foreign-cores", "0",
                                            *split, "--out", "serving_pytriton_test"],
                             tmp_path, name="serving_pytriton_test")
    machine_recorded(doc)
    m = doc["machine"]
    assert os.sched_getaffinity(0) == set(cores), "the test's process got its cores back"
    if split:
        assert m["servers_ran_on"] == {"batching_on": cores[-1:], "batching_off": cores[-1:]}, m["servers_ran_on"]
        assert m["client_cpus"] == cores[:1] and f"load generator {cores[:1]}" in doc["stdout"]
    assert doc["settings"]["reps"] == 1 and doc["settings"]["device"] == "cpu"
    medians = doc["medians_samples_per_s"]
    assert {"w2_inprocess_256", "w2_server_256", "w3_inprocess_8", "w3_on", "w3_off"} <= set(medians)
    positive(medians)
    for name in ("w2_server_over_inprocess", "w3_on_over_off", "w3_on_over_inprocess_256"):
        positive({name: doc["ratios"][name]["headline"]})
    for name, reps in doc["per_rep"].items():
        assert all(r["errors"] == 0 for r in reps), f"{name}: requests failed"
    assert set(doc["server_exit_codes"].values()) == {0}
    # The batching server's CPU a request by kind of thread, for both workloads: the model's share
    # and the event loop's are never zero, none is negative, and the table prints them.
    by_thread = doc["server_ms_per_request_medians"]
    assert set(by_thread) == {"w2_server_256", "w3_on"}, by_thread
    for name, kinds in by_thread.items():
        assert set(kinds) == {"event loop", "gRPC", "model instances", "other"}, kinds
        assert kinds["model instances"] > 0 and kinds["event loop"] > 0 and min(kinds.values()) >= 0, (name, kinds)
    assert by_thread["w2_server_256"]["model instances"] > by_thread["w3_on"]["model instances"]  # 256 rows vs 8
    assert "server CPU ms a request" in doc["stdout"]

    # PyTriton ran with the batching teacher-server's layout and answered what the model computes.
    pt = doc["pytriton"]
    assert pt["enabled"] and pt["why"] == "on (--pytriton)"
    assert pt["instances"] == doc["machine"]["server_instances"]
    assert pt["torch_threads"] == doc["machine"]["server_torch_threads"]
    assert (pt["max_batch_size"], pt["max_queue_delay_us"]) == (doc["settings"]["max_batch"],
                                                              doc["settings"]["delay_us"])
    diffs = doc["output_max_abs_diff"]
    assert set(diffs) == {"batching_on", "batching_off", "pytriton"} and 0 <= diffs["pytriton"] <= 1e-3
    assert doc["server_exit_codes"]["pytriton"] == 0

    medians = doc["medians_samples_per_s"]
    assert medians["w2_pytriton_256"] > 0 and medians["w3_pytriton"] > 0
    (w2,) = doc["per_rep"]["w2_pytriton_256"]
    (w3,) = doc["per_rep"]["w3_pytriton"]
    assert w2["errors"] == 0 and w3["errors"] == 0
    assert w2["mean_server_batch"] == 256  # whole batch-256 requests, never split or merged
    assert w3["mean_server_batch"] > 8  # Triton's dynamic batcher merged the batch-8 requests

    ratios = doc["ratios"]
    assert (ratios["w2_server_over_pytriton"]["goal"], ratios["w2_server_over_pytriton"]["goal_op"]) == (1.3, ">=")
    assert (ratios["w3_on_over_pytriton"]["goal"], ratios["w3_on_over_pytriton"]["goal_op"]) == (1.0, ">")
    assert ratios["w2_server_over_pytriton"]["verdict"] == "smoke test only"
    for row in ("W2 PyTriton saturated, batch 256", "W3 PyTriton batching, 64 x batch 8",
                "W2 server / PyTriton (batch 256)", "W3 batching on / PyTriton (64 x batch 8)"):
        assert row in doc["stdout"]


def test_pytriton_is_left_out_unless_the_run_is_cpu_fp32_or_asked_for() -> None:
    off = serving.parse_args(["--no-pytriton"])
    assert off.pytriton == "off" and serving.pytriton_venv_for(off) == (None, "left out (--no-pytriton)")
    cuda = serving.Settings(device="cuda", compute_dtype="FP16")  # auto: never on another device
    venv, why = serving.pytriton_venv_for(cuda)
    assert venv is None and "CPU in FP32" in why
    assert serving.parse_args([]).pytriton == "auto" and serving.parse_args(["--pytriton"]).pytriton == "on"


def test_pytriton_on_another_device_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.parse_args(["--pytriton", "--compute-dtype", "FP16"])
    assert exited.value.code == 2
    assert "--pytriton serves the model on the CPU in FP32: drop --device/--compute-dtype, or --pytriton" in \
        capsys.readouterr().err
