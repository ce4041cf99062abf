"""benchmarks.trace_gaps: the device's idle gaps on a Chrome trace and the host's calls during them.

The arithmetic on a hand-built trace of the shape torch.profiler writes for CUDA (kernels and
copies on the device, runtime calls and operators on the host), then a real trace written by
torch.profiler on this machine, where nothing runs on a device."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import trace_gaps


def _x(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


def _trace() -> list[dict[str, object]]:
    # Device: 0-100 and 50-120 overlap (busy 0-120), a 30 us gap, 150-200, a 500 us gap, 700-800,
    # a copy 805-810 after a 5 us gap.
    return [
        _x("kernel", "gemm", 0, 100), _x("kernel", "gemm", 50, 70), _x("kernel", "softmax", 150, 50),
        _x("kernel", "gemm", 700, 100), _x("gpu_memcpy", "Memcpy DtoH", 805, 5),
        # Host: a sync over most of the long gap, an allocation inside it, an operator spanning both gaps.
        _x("cuda_runtime", "cudaStreamSynchronize", 180, 400), _x("cuda_runtime", "cudaMalloc", 600, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 120, 2), _x("cpu_op", "aten::topk", 100, 650),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 400},  # not a complete event: ignored
    ]


def test_gaps_and_the_host_calls_during_them() -> None:
    events = [e for e in _trace() if e["ph"] == "X"]
    assert trace_gaps.device_intervals(events) == [(0, 120), (150, 200), (700, 800), (805, 810)]
    s = trace_gaps.summarize(events, min_gap_us=20)
    assert s["span_ms"] == 0.81 and s["busy_ms"] == 0.275 and s["busy_fraction"] == round(275 / 810, 3)
    assert s["gaps"] == 2 and s["idle_in_gaps_ms"] == 0.53 and s["largest_gaps_ms"] == [0.5, 0.03]
    # The sync covers 200-580 of the 200-700 gap, the allocation 600-650, the launch 120-122 of 120-150.
    assert s["cuda_calls_in_gaps_ms"] == [["cudaStreamSynchronize", 0.38], ["cudaMalloc", 0.05],
                                          ["cudaLaunchKernel", 0.002]]
    assert s["ops_in_gaps_ms"] == [["aten::topk", 0.53]]
    assert "cudaStreamSynchronize 0.38 ms" in trace_gaps.report("t", s)


def test_a_cpu_trace_has_no_device_timeline(tmp_path: Path) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.linear(torch.randn(64, 32), torch.randn(16, 32)).softmax(-1)
    raw = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(tmp_path / "cpu.json.gz", "wb") as dst:
        dst.write(src.read())
    for path in (raw, tmp_path / "cpu.json.gz"):
        events = trace_gaps.load_trace(path)
        assert any("linear" in str(e.get("name")) for e in events)
        s = trace_gaps.summarize(events)
        assert s["device_events"] == 0 and "no device activity" in s["note"]
    assert trace_gaps.main([str(raw), "--min-gap-ms", "0.5"]) == 0


def test_the_command_line_refuses_bad_settings(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    assert trace_gaps.main([str(path)]) == 0
    for bad in (["--top", "0"], ["--min-gap-ms", "-1"]):
        try:
            trace_gaps.main([str(path), *bad])
        except SystemExit as e:
            assert e.code == 2, bad
        else:
            raise AssertionError(f"{bad} was accepted")
