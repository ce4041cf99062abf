"""benchmarks/teacher_memory.py end to end in a small setting: both modes run in their own
processes, send the same bytes, and the chunked mode's scoring peak is the smaller one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import teacher_memory

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


def test_chunked_scoring_needs_less_memory_than_whole_logits(tmp_path: Path) -> None:
    """1,024 positions at a 32,000 vocabulary: whole fp32 logits and their log-softmax are 250 MiB,
    chunks of 4 MiB keep the scoring's own peak far below that."""
    env = {**os.environ, "DISTILL_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.teacher_memory", "--seq", "1024", "--vocab", "32000",
                           "--chunk-mib", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "teacher_memory.json").read_text())
    whole, chunked = data["modes"]
    assert (whole["mode"], chunked["mode"]) == ("whole", "chunked")
    assert whole["response_bytes"] == chunked["response_bytes"] == 1024 * (16 * 4 * 2 + 4 + 4)
    assert whole["scoring_bytes"] > 200 * teacher_memory.MiB
    assert chunked["scoring_bytes"] < whole["scoring_bytes"] / 2
