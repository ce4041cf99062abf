"""benchmarks.instances end to end on the CPU: one server per instance count, the in-process
reference, and the figures the GPU default is chosen from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import instances
from benchmarks.cv_teacher import IO as CV_IO
from examples.refteacher import IO as REF_IO
from tests.bench_runs import run_benchmark_main


def test_a_request_is_built_from_the_models_declared_input() -> None:
    images = instances.build_request(CV_IO, 4)
    assert (images.inputs[0].name, images.inputs[0].datatype, list(images.inputs[0].shape)) == \
        ("IMAGES", "UINT8", [4, 3, 224, 224])
    assert len(images.raw_input_contents[0]) == 4 * 3 * 224 * 224 and images.outputs[0].name == "LOGITS"
    name, datatype, x = instances.sample_input(REF_IO, 2)
    assert (name, datatype, x.dtype, x.shape) == ("INPUT", "FP32", np.float32, (2, 3, 32, 32))


@pytest.mark.timeout(300)  # the bound its benchmark had in a process of its own
def test_the_benchmark_compares_instance_counts_with_the_in_process_model(tmp_path: Path) -> None:
    doc = run_benchmark_main(instances.main, ["--counts", "1,2", "--clients", "4", "--batch", "4", "--inproc-batch",
                                              "16", "--reps", "1", "--duration", "0.5", "--out", "instances_test"],
                             tmp_path, name="instances_test")
    rates = doc["median_samples_per_s"]
    assert set(rates) == {"in_process", "instances_1", "instances_2"} and all(v > 0 for v in rates.values())
    assert doc["over_first_count"]["instances_1"] == 1.0 and doc["best_count"] in (1, 2)
    assert doc["settings"]["device"] == "cpu" and doc["settings"]["gpu"] is None


def test_bad_instance_counts_are_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by argparse before anything starts: the entry point runs in this process."""
    with pytest.raises(SystemExit) as exited:
        instances.main(["--counts", "1,x"])
    assert exited.value.code == 2 and "give instance counts >= 1, comma-separated" in capsys.readouterr().err
