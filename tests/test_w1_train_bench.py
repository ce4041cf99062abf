"""benchmarks.w1_train end to end on the CPU: a real student trained three ways (hard labels, the
teacher in process, the teacher served through DistillReader), the served logits checked first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_runs import run_benchmark_main


@pytest.mark.timeout(300)  # the bound its benchmark had in a process of its own
def test_the_benchmark_trains_a_student_with_the_teacher_in_process_and_served(tmp_path: Path) -> None:
    from benchmarks import w1_train

    doc = run_benchmark_main(w1_train.main, ["--quick", "--steps", "3", "--reps", "1", "--batch", "8", "--out",
                                             "w1_train_test"], tmp_path, name="w1_train_test")
    rates = doc["median_samples_per_s"]
    assert set(rates) == {"pure", "inline", "service"} and all(v > 0 for v in rates.values())
    assert set(doc["ratios"]) == {"service_vs_pure", "service_vs_inline", "inline_vs_pure"}
    assert doc["check"]["max_abs_diff"] < 1e-3 and doc["check"]["argmax_agreement"] == 1.0
    assert doc["settings"]["device"] == "cpu" and doc["settings"]["gpu"] is None
    assert doc["settings"]["image"] == [3, 32, 32] and doc["settings"]["classes"] == 10


def test_a_teacher_that_does_not_take_images_is_refused_with_what_it_must_declare() -> None:
    """Refused from the teacher's declaration before any server starts: the entry point runs in this
    process, and its exit (a non-zero status with this message) is the SystemExit it raises."""
    from benchmarks import w1_train

    with pytest.raises(SystemExit) as exited:
        w1_train.main(["--quick", "--teacher", "tests.models:affine"])
    assert exited.value.code != 0
    assert "must declare one UINT8 input (images) and one output (logits)" in str(exited.value.code)
