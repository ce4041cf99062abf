"""benchmarks.instance_pipeline drives one ModelInstance over W6's length-sorted batches, as the
batcher does, against the same batches run alone and by a plain loop, with the attention mask and
without it; on the CPU host and device are one, so the run is checked for what it reports, and
the traces it writes must hold the instance's work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import instance_pipeline
from benchmarks.common import sorted_groups
from tests.hf_models import save_llama


def test_sorted_groups_cut_at_the_budget_and_the_row_cap() -> None:
    assert sorted_groups([5, 1, 4, 2, 3], budget=8, size=int, max_rows=8) == [[1, 2], [3, 4], [5]]
    assert sorted_groups([1, 1, 1, 1, 1], budget=100, size=int, max_rows=2) == [[1, 1], [1, 1], [1]]
    assert sorted_groups([20, 1], budget=8, size=int) == [[1], [20]]  # one larger than the budget: alone


def test_the_instance_pipeline_benchmark_reports_both_masks_and_writes_traces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.common.RESULTS_DIR", tmp_path)
    save_llama(tmp_path / "llama")
    argv = ["--teacher", str(tmp_path / "llama"), "--sequences", "12", "--budget", "64", "--max-rows", "4",
            "--trace", str(tmp_path / "traces"), "--out", "ip"]
    assert instance_pipeline.main(argv) == 0
    doc = json.loads((tmp_path / "ip.json").read_text())
    assert doc["device"] == "cpu" and doc["batches"] >= 3 and doc["useful"] <= doc["positions"]
    for label in ("masked", "unmasked"):
        r = doc[label]
        assert r["device_s"] > 0 and r["loop_s"] > 0 and r["instance_s"] > 0
        assert r["instance_busy"] == pytest.approx(r["device_s"] / r["instance_s"], abs=2e-3)
        assert r["instance_useful_tokens_per_s"] > 0
        assert r["instance_allocator"] == r["loop_allocator"] == {}  # counted on CUDA only
        # On the CPU the traces have no device timeline; the summary says so instead of inventing one.
        assert r["trace_gaps"]["device_events"] == 0 and r["loop_trace_gaps"]["device_events"] == 0
    names = sorted(Path(p).name for p in doc["traces"])
    assert names == ["instance_masked.json.gz", "instance_unmasked.json.gz", "loop_masked.json.gz",
                     "loop_unmasked.json.gz"]
    with gzip.open(tmp_path / "traces" / "instance_unmasked.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any("linear" in str(e.get("name", "")) for e in events), "the trace holds none of the forward pass"


def test_the_instance_pipeline_benchmark_refuses_bad_sizes(tmp_path: Path) -> None:
    for bad in (["--ahead", "0"], ["--budget", "0"], ["--sequences", "0"]):
        with pytest.raises(SystemExit) as e:
            instance_pipeline.main(["--teacher", str(tmp_path), *bad])
        assert e.value.code == 2, bad
