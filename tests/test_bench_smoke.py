"""The workload benchmarks end to end at their smallest settings: each runs its own entry point
(``main``, in the test's process: a fresh interpreter would import torch again; the discovery one
as a subprocess) with real teacher-server processes and a real etcd where the workload has one,
writes its JSON (and plot) to a temporary directory, so the measured files are never replaced,
and the figures in it must be sane: counts as asked, rates and ratios positive and
finite, nothing lost, duplicated or wrong, the machine recorded. Speed is the benchmarks' business:
no figure is compared with a goal here.

W1/W5 (`benchmarks.mesh`), W4 (`benchmarks.autoscale`), the teacher-output store
(`benchmarks.cache`), discovery (`benchmarks.discovery_propagation`) and the soak
(`benchmarks.soak`). The other benchmarks' smoke tests are in their own files, W2/W3's with its
PyTriton side in test_serving_pytriton_bench.py (benchmarks/README.md lists them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import cache, mesh, soak
from benchmarks.autoscale import run as autoscale
from tests.bench_runs import machine_recorded, positive, run_benchmark, run_benchmark_main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(330)
def test_mesh_w1_and_w5_run_and_report_sane_figures(tmp_path: Path) -> None:
    # One W1 teacher and two W5 teachers (a teacher server's start is seconds of CPU): the service
    # mode still runs over the mesh, and W5 still kills one teacher while another takes its work.
    doc = run_benchmark_main(mesh.main, ["--quick", "--reps", "1", "--steps", "10", "--teachers", "1",
                                         "--w5-teachers", "2"], tmp_path, name="mesh_quick_teachers1_w5teachers2")
    machine_recorded(doc)
    assert len(doc["machine"]["load_average_at_start"]) == 3
    w1 = doc["w1"]
    assert set(w1["medians_samples_per_s"]) == {"pure", "inline", "service"}
    positive(w1["medians_samples_per_s"])
    positive(w1["ratios"])
    assert w1["outputs_checked"] > 0 and w1["wrong_outputs"] == 0
    assert w1["server_exit_codes"] == [0]
    # W5: the teacher with work in flight is SIGKILLed; every batch arrives once, in order, correct.
    w5 = doc["w5"]
    assert w5["signal"] == "SIGKILL" and w5["victim_exit_code"] == -9 and w5["teachers"] == 2
    assert w5["delivered"] == w5["batches"] == 60
    assert (w5["lost"], w5["duplicated"], w5["out_of_order"], w5["wrong_outputs"]) == (0, 0, 0, 0)
    assert 0 < w5["longest_gap_ms"] < math.inf


@pytest.mark.timeout(330)
def test_cache_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    # One live teacher for the loop and record sections (each teacher server is seconds of CPU).
    doc = run_benchmark_main(cache.main, ["--quick", "--reps", "1", "--teachers", "1"], tmp_path, name="cache_quick")
    assert doc["settings"]["teachers"] == 1
    machine_recorded(doc)
    loop = doc["loop"]
    positive(loop["medians_samples_per_s"])
    positive(loop["ratios"])
    assert loop["wrong_outputs"] == {"store": 0, "live": 0}
    assert loop["outputs_checked"]["store"] > 0 and loop["store"]["duplicates"] == 0
    positive({"record_vs_serving": doc["record"]["record_vs_serving"]})
    # The CV example's 10 fp16 logits are 20 bytes a sample; the LLM's top-20 fp16 values and int16
    # ids 80 bytes a token; the store's keys and framing come on top.
    assert 20 < doc["cv_bytes"]["bytes_per_sample"] < 100
    assert 80 < doc["llm_bytes"]["bytes_per_token"] < 160
    positive(doc["integrity"]["median_mb_per_s"])


@pytest.mark.timeout(120)
def test_discovery_propagation_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    doc = run_benchmark("discovery_propagation", ["--repetitions", "3", "--crash-repetitions", "1", "--ttl", "1"],
                        tmp_path, name="discovery_propagation", timeout=100)
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["etcd"].startswith("etcd Version")
    for name in ("join", "join_raw_put", "leave_on_exit"):
        assert doc[name]["n"] == 3 and len(doc["raw_s"][name]) == 3
        positive({k: doc[name][k] for k in ("median_ms", "max_ms", "min_ms")})
    assert doc["crash"]["n"] == 1 and doc["crash"]["ttl_s"] == 1.0
    positive({"crash": doc["crash"]["median_ms"]})


@pytest.mark.timeout(270)
def test_soak_runs_and_reports_sane_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Exit status 1 is the soak's RSS verdict, which 6 s cannot decide (a fresh etcd still grows by
    # a few percent); every other verdict must hold.
    monkeypatch.setattr(soak, "RESULTS_DIR", tmp_path)  # where its plot goes
    doc = run_benchmark_main(soak.main, ["--quick", "--minutes", "0.1", "--warmup", "2", "--interval", "2",
                                         "--students", "2", "--teachers", "2"], tmp_path, name="soak_quick",
                             exit_codes=(0, 1))
    machine_recorded(doc)
    assert doc["verdict"]["errors_ok"]
    assert doc["exit_code"] == 0 or not doc["verdict"]["rss_ok"]
    totals = doc["totals"]
    assert {k: totals[k] for k in ("errors", "exceptions", "lost", "duplicated", "wrong_output")} == dict.fromkeys(
        ("errors", "exceptions", "lost", "duplicated", "wrong_output"), 0)
    assert set(doc["students"]) == {"student0", "student1"} and not doc["students_without_final_report"]
    assert totals["samples"] == sum(st["samples"] for st in doc["students"].values()) > 0
    assert totals["samples"] == 32 * totals["batches"]
    assert len(doc["timeline"]) == 3  # 6 s in windows of 2 s
    positive({f"window {i}": w["samples_per_s"] for i, w in enumerate(doc["timeline"])})
    assert {r["process"] for r in doc["rss"]} == {"etcd", "teacher0", "teacher1", "student0", "student1"}
    positive({r["process"]: r["rss_end_mb"] for r in doc["rss"]})
    assert (tmp_path / "soak_quick.png").stat().st_size > 0


@pytest.mark.timeout(330)
def test_autoscale_w4_runs_and_reports_sane_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Phases of 3 / 2 / 2 s: too short for the goals (the scale-up takes a teacher's start-up), long
    # enough for both pools to train every phase (the first one also opens the first reader).
    monkeypatch.setattr(autoscale, "RESULTS_DIR", tmp_path)  # where its plot goes
    doc = run_benchmark_main(autoscale.main, ["--quick", "--phases", "3,2,2"], tmp_path, name="autoscale_quick")
    machine_recorded(doc)
    assert doc["settings"]["phases_s"] == [3.0, 2.0, 2.0] and doc["oracle"]["needed"] == [1, 3, 1]
    assert [s["mode"] for s in doc["summaries"]] == ["autoscaled", "fixed"]
    for s in doc["summaries"]:
        assert s["reader_failures"] == 0 and s["errors"] == [], s["mode"]
        positive({f"{s['mode']} phase {i}": n for i, n in enumerate(s["samples_per_phase"])})
        positive({f"{s['mode']} capacity": s["measured_teacher_capacity"], "teacher-s": s["teacher_seconds"]})
    autoscaled, fixed = doc["runs"]
    # The autoscaler brought the empty pool to its minimum of 1 and published why; that teacher registered.
    first = autoscaled["decisions"][0]
    assert (first["action"], first["from"], first["desired"]) == ("up", 0, 1) and first["reason"]
    assert any(e["event"] == "registered" for e in autoscaled["registry_events"])
    assert len(fixed["teachers"]) == 3
    positive({"throughput_vs_fixed": doc["comparison"]["headline"]["throughput_vs_fixed"]})
    assert (tmp_path / "autoscale_quick.png").stat().st_size > 0
