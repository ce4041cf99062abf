"""benchmarks.batching_sim: a real teacher-server process serving an emulated GPU (forward passes
queued on one device timeline, finished at its time, batches formed ahead as on CUDA) to clients
sending one sequence a request; its report compares the server's batches with length-sorted ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import batching_sim
from benchmarks.batching_sim import draw_lengths, sorted_baseline
from tests.bench_runs import run_benchmark_main

pytestmark = pytest.mark.timeout(180)


def test_the_sorted_baseline_cuts_sorted_lengths_at_the_budget() -> None:
    b = sorted_baseline([5, 1, 4, 2, 3], budget=8, fixed_s=1.0, per_token_s=0.5)
    # sorted 1 2 3 4 5: [1, 2] (2 x 2 = 4; adding 3 would be 3 x 3 = 9), [3, 4] (2 x 4 = 8), [5] (5)
    assert b["batches"] == 3
    assert b["seconds"] == pytest.approx(3 * 1.0 + 0.5 * (4 + 8 + 5))
    assert b["padding_efficiency"] == pytest.approx(15 / 17)
    assert draw_lengths(50, 3) == draw_lengths(50, 3) and min(draw_lengths(500, 1)) >= 8


def test_the_batching_simulation_runs_on_the_emulated_device(tmp_path: Path) -> None:
    fixed_ms, rate = 2.0, 400_000.0
    doc = run_benchmark_main(batching_sim.main, [
        "--sequences", "96", "--clients", "24", "--budget", "4096", "--fixed-ms", str(fixed_ms), "--tokens-per-s",
        str(rate), "--reps", "1", "--out", "sim"], tmp_path, name="sim")
    (rep,) = doc["reps"]
    lengths = draw_lengths(96, 0)
    assert doc["baseline"] == sorted_baseline(lengths, 4096, fixed_ms / 1e3, 1 / rate)
    # The finishing stage waited for the emulated device: no pass can beat its timeline, which
    # runs every batch's fixed cost and at least every real position one after another.
    assert rep["seconds"] >= rep["batches"] * fixed_ms / 1e3 + sum(lengths) / rate
    assert rep["batches"] >= -(-sum(lengths) // 4096)  # no batch holds more than the budget
    assert 0.3 < rep["padding_efficiency"] <= 1.0 and 0 < doc["ratio_median"] <= 1.1


def test_the_reader_path_runs_on_the_emulated_device(tmp_path: Path) -> None:
    """--student-batch: DistillReader over padded batches in loader order, the router pinned to
    keep --clients rows in flight; the server still counts every real token once."""
    fixed_ms, rate = 2.0, 400_000.0
    doc = run_benchmark_main(batching_sim.main, [
        "--sequences", "96", "--clients", "32", "--budget", "4096", "--fixed-ms", str(fixed_ms), "--tokens-per-s",
        str(rate), "--reps", "2", "--student-batch", "8", "--out", "simr"], tmp_path, name="simr")
    assert doc["settings"]["student_batch"] == 8 and doc["settings"]["router"] == "pinned"
    lengths = draw_lengths(96, 0)
    for rep in doc["reps"]:
        assert rep["seconds"] >= rep["batches"] * fixed_ms / 1e3 + sum(lengths) / rate
        assert 0.3 < rep["padding_efficiency"] <= 1.0
    assert "DistillReader, batches of 8 in loader order, pinned router" in doc["stdout"]


def test_students_and_teachers_share_the_emulated_devices(tmp_path: Path) -> None:
    """--students 2 --teachers 2: two readers over every other batch, two teacher processes each
    with its own emulated device; every real token is counted (some perhaps twice, reported)."""
    fixed_ms, rate = 2.0, 400_000.0
    doc = run_benchmark_main(batching_sim.main, [
        "--sequences", "96", "--budget", "4096", "--fixed-ms", str(fixed_ms), "--tokens-per-s", str(rate), "--reps",
        "1", "--student-batch", "8", "--router", "defaults", "--students", "2", "--teachers", "2", "--hedge", "--out",
        "simst"], tmp_path, name="simst")
    (rep,) = doc["reps"]
    lengths = draw_lengths(96, 0)
    # Two devices: each runs its batches' fixed costs and real positions one after another.
    assert rep["seconds"] >= (rep["batches"] * fixed_ms / 1e3 + sum(lengths) / rate) / 2
    assert rep["duplicated"] >= 0 and 0.3 < rep["padding_efficiency"] <= 1.0
    assert "2 x DistillReader, batches of 8 in loader order, defaults router" in doc["stdout"]


def test_reader_router_pins_or_leaves_the_limit() -> None:
    from benchmarks.batching_sim import reader_router
    from distill import RouterConfig

    pinned = reader_router("pinned", 20)
    assert pinned.initial_limit == pinned.min_limit == 20.0 and pinned.max_limit == 20
    assert reader_router("pinned", 40, 16).by_length_rows == 4 * 40 * 16  # a quarter covers 40 requests
    assert reader_router("default", 20) == reader_router("defaults", 20) == RouterConfig()
