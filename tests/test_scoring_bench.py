"""benchmarks.vllm_json (vLLM's JSON scoring against our gRPC) and benchmarks.gateway (one URL for
the trainers against the teacher direct) end to end in their smoke modes: real teacher processes,
a real gateway, their JSON sane; and both take --device and --compute-dtype like every serving
benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vllm_json

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parent.parent


def _run(module: str, tmp_path: Path) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(REPO), DISTILL_BENCH_RESULTS=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--quick", "--compute-dtype", "FP32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, object] = json.loads((tmp_path / f"{module}_quick.json").read_text())
    settings = doc["settings"]
    assert isinstance(settings, dict)
    assert (settings["device"], settings["compute_dtype"]) == ("cpu", "FP32")
    return doc


def test_the_scoring_benchmark_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = _run("vllm_json", tmp_path)
    summary = doc["summary"]
    assert isinstance(summary, dict) and set(summary) == set(vllm_json.VARIANTS)
    assert all(v["tokens_per_s"] > 0 and v["bytes_per_token"] > 0 for v in summary.values())
    # top-20 log-probs in fp16 over gRPC take fewer bytes a token than fp32, and far fewer than JSON
    assert summary["grpc-fp16"]["bytes_per_token"] < summary["grpc-fp32"]["bytes_per_token"]
    assert summary["json"]["bytes_per_token"] > 3 * summary["grpc-fp16"]["bytes_per_token"]


def test_the_gateway_benchmark_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = _run("gateway", tmp_path)
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
