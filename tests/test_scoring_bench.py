"""benchmarks.vllm_json (vLLM's JSON scoring against our gRPC) and benchmarks.gateway (one URL for
the trainers against the teacher direct) end to end in their smoke modes: real teacher processes,
a real gateway, their JSON sane; and both take --device and --compute-dtype like every serving
benchmark."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import gateway, vllm_json
from tests.bench_runs import run_benchmark_main

pytestmark = pytest.mark.timeout(240)


def _run(module: ModuleType, tmp_path: Path) -> dict[str, object]:
    name = module.__name__.rsplit(".", 1)[-1]
    doc = run_benchmark_main(module.main, ["--quick", "--compute-dtype", "FP32"], tmp_path, name=f"{name}_quick")
    settings = doc["settings"]
    assert isinstance(settings, dict)
    assert (settings["device"], settings["compute_dtype"]) == ("cpu", "FP32")
    return doc


def test_the_scoring_benchmark_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = _run(vllm_json, tmp_path)
    summary = doc["summary"]
    assert isinstance(summary, dict) and set(summary) == set(vllm_json.VARIANTS)
    assert all(v["tokens_per_s"] > 0 and v["bytes_per_token"] > 0 for v in summary.values())
    # top-20 log-probs in fp16 over gRPC take fewer bytes a token than fp32, and far fewer than JSON
    assert summary["grpc-fp16"]["bytes_per_token"] < summary["grpc-fp32"]["bytes_per_token"]
    assert summary["json"]["bytes_per_token"] > 3 * summary["grpc-fp16"]["bytes_per_token"]


def test_the_gateway_benchmark_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = _run(gateway, tmp_path)
    summary = doc["summary"]
    assert isinstance(summary, dict) and set(summary) == {"direct", "gateway"}
    assert all(v["tokens_per_s"] > 0 for v in summary.values())
    ratio = doc["gateway_vs_direct_throughput"]
    assert isinstance(ratio, float) and ratio > 0
    assert summary["gateway"]["gateway_cpu_us_per_token"] > 0
    # Direct calls bypass the gateway: it spends at most its background work (pool probes) meanwhile,
    # counted in clock ticks, so a tick or two (2 x 10 ms over a quick run's few tokens) is allowed.
    tokens = doc["tokens"]
    assert isinstance(tokens, int) and tokens > 0
    assert summary["direct"]["gateway_cpu_us_per_token"] * tokens <= 2 * 1e6 / os.sysconf("SC_CLK_TCK") + 1


def test_both_take_a_device_and_a_compute_dtype() -> None:
    s = vllm_json.parse_args(["--device", "cuda:1", "--compute-dtype", "bf16"])
    assert (s.device, s.compute_dtype) == ("cuda:1", "BF16")
    assert vllm_json.parse_args(["--quick", "--compute-dtype", "fp16"]).compute_dtype == "FP16"
    with pytest.raises(SystemExit):
        vllm_json.parse_args(["--device", "gpu"])
