"""benchmarks.launches counts the host's ATen calls for a batch of an hf: causal LM: the forward
pass, the server's chunked output transforms and the in-process baseline. Counts, not times, so
they can be checked: larger chunks make fewer calls, each chunk costs a bounded number of them,
and the results file says what was counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import launches


def test_the_launch_count_benchmark_counts_what_a_chunk_costs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.common.RESULTS_DIR", tmp_path)
    assert launches.main(["--shape", "qwen2.5-tiny", "--tokens", "2048", "--chunks", "16,64", "--out", "l"]) == 0
    doc = json.loads((tmp_path / "l.json").read_text())
    small, large = doc["transforms"]
    assert (small["chunk_mib"], large["chunk_mib"]) == (16, 64)
    per_chunk = (16 << 20) // (151936 * 4)
    assert small["positions_per_chunk"] == per_chunk and small["chunks"] == -(-2048 // per_chunk)
    assert small["chunks"] > large["chunks"] >= 1
    # every chunk costs the same calls: at most 16 (projection, log-softmax, top-k, tail, copies)
    extra = (small["calls"] - large["calls"]) / (small["chunks"] - large["chunks"])
    assert extra == int(extra) and 8 <= extra <= 16, extra
    assert doc["forward"]["non_view_calls"] > 10 * doc["baseline"]["non_view_calls"] > 0
    assert doc["default_chunk_mib"] == 256 and doc["machine"]["cpu_count"] == os.cpu_count()
