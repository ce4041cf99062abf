"""benchmarks.host_bound times one batch of an hf: causal LM on the host and on the device: the
forward pass, the server's output transforms at each chunk size and the in-process baseline's
whole-batch top-k, and names the calls that make the host wait for the device. On the CPU host and
device time are one and nothing synchronises; the results file must still say so, shape by shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import host_bound
from tests.hf_models import save_llama


def test_the_host_bound_benchmark_times_every_stage_of_a_batch(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.common.RESULTS_DIR", tmp_path)
    save_llama(tmp_path / "llama")
    argv = ["--teacher", str(tmp_path / "llama"), "--compute-dtype", "FP32", "--shapes", "4x32,8x16", "--reps", "2",
            "--chunks", "1,4", "--out", "hb"]
    assert host_bound.main(argv) == 0
    doc = json.loads((tmp_path / "hb.json").read_text())
    assert doc["device"] == "cpu" and doc["gpu"] is None and doc["chunks_mib"] == [1, 4] and doc["vocab"] == 97
    assert [(r["rows"], r["length"], r["positions"]) for r in doc["shapes"]] == [(4, 32, 128), (8, 16, 128)]
    for r in doc["shapes"]:
        for stage in ("forward", "forward_unmasked", "transforms_1", "transforms_4", "baseline"):
            assert r[f"{stage}_host_ms"] == r[f"{stage}_device_ms"] > 0, (stage, r)
        assert r["host_over_device"] == 1.0 and r["syncs_per_batch"] == 0 and r["sync_sites"] == {}
        assert r["unmasked_forward_syncs_per_batch"] == 0
        assert r["device_positions_per_s"] > 0


def test_the_host_bound_benchmark_refuses_bad_shapes(tmp_path: Path) -> None:
    for bad in (["--shapes", "4by32"], ["--shapes", "1x32"], ["--chunks", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit) as e:
            host_bound.main(["--teacher", str(tmp_path), *bad])
        assert e.value.code == 2, bad
