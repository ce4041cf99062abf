"""benchmarks/teacher_memory.py end to end in a small setting: both modes run in their own
processes, send the same bytes, and the chunked mode's scoring peak is the smaller one."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import teacher_memory
from tests.bench_runs import run_benchmark_main

pytest.importorskip("transformers")


@pytest.mark.timeout(300)  # the bound its benchmark had in a process of its own
def test_chunked_scoring_needs_less_memory_than_whole_logits(tmp_path: Path) -> None:
    """1,024 positions at a 32,000 vocabulary: whole fp32 logits and their log-softmax are 250 MiB,
    chunks of 4 MiB keep the scoring's own peak far below that."""
    data = run_benchmark_main(teacher_memory.main, ["--seq", "1024", "--vocab", "32000", "--chunk-mib", "4"],
                              tmp_path, name="teacher_memory")
    whole, chunked = data["modes"]
    assert (whole["mode"], chunked["mode"]) == ("whole", "chunked")
    assert whole["response_bytes"] == chunked["response_bytes"] == 1024 * (16 * 4 * 2 + 4 + 4)
    assert whole["scoring_bytes"] > 200 * teacher_memory.MiB
    assert chunked["scoring_bytes"] < whole["scoring_bytes"] / 2
