"""benchmarks.instances end to end on the CPU: one server per instance count, the in-process
reference, and the figures the GPU default is chosen from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import instances
from benchmarks.cv_teacher import IO as CV_IO
from examples.refteacher import IO as REF_IO

REPO = Path(__file__).resolve().parent.parent


def test_a_request_is_built_from_the_models_declared_input() -> None:
    images = instances.build_request(CV_IO, 4)
    assert (images.inputs[0].name, images.inputs[0].datatype, list(images.inputs[0].shape)) == \
        ("IMAGES", "UINT8", [4, 3, 224, 224])
    assert len(images.raw_input_contents[0]) == 4 * 3 * 224 * 224 and images.outputs[0].name == "LOGITS"
    name, datatype, x = instances.sample_input(REF_IO, 2)
    assert (name, datatype, x.dtype, x.shape) == ("INPUT", "FP32", np.float32, (2, 3, 32, 32))


def test_the_benchmark_compares_instance_counts_with_the_in_process_model(tmp_path: Path) -> None:
    env = {**os.environ, "DISTILL_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.instances", "--counts", "1,2", "--clients", "4",
                           "--batch", "4", "--inproc-batch", "16", "--reps", "1", "--duration", "0.5",
                           "--out", "instances_test"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "instances_test.json").read_text())
    rates = doc["median_samples_per_s"]
    assert set(rates) == {"in_process", "instances_1", "instances_2"} and all(v > 0 for v in rates.values())
    assert doc["over_first_count"]["instances_1"] == 1.0 and doc["best_count"] in (1, 2)
    assert doc["settings"]["device"] == "cpu" and doc["settings"]["gpu"] is None


def test_bad_instance_counts_are_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by argparse before anything starts: the entry point runs in this process."""
    with pytest.raises(SystemExit) as exited:
        instances.main(["--counts", "1,x"])
    assert exited.value.code == 2 and "give instance counts >= 1, comma-separated" in capsys.readouterr().err
