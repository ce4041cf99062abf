"""Every example's scripts in smoke mode, against real teacher servers: CV and NLP (the elastic
example's runs under a real ``torchrun`` are tests/test_elastic.py's).

The scripts' ``main()`` run in this process where that is enough (faster: torch is imported
once); the server side is real: ``serve --smoke`` starts ``teacher-server`` subprocesses, and
students talk gRPC to a ``TeacherServer`` loading the example's own ``module:factory``. Trained
weights go to a temporary cache.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.common import CACHE_ENV
from examples.cv import data as cv_data
from examples.cv import export as cv_export
from examples.cv import serve as cv_serve
from examples.cv import train_student as cv_student
from examples.cv import train_teacher as cv_teacher
from examples.nlp import export as nlp_export
from examples.nlp import serve as nlp_serve
from examples.nlp import train_student as nlp_student
from examples.nlp import train_teacher as nlp_teacher
from teacher_server import BatchingConfig, ServerConfig
from tests.servers import REPO, ServerThread

pytestmark = pytest.mark.slow

EXAMPLES = ("cv", "nlp", "elastic")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir (where train_teacher writes and the factories read), for this module."""
    path = tmp_path_factory.mktemp("distill-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(path))
        for var in ("DISTILL_CV_TEACHER", "DISTILL_NLP_TEACHER"):
            mp.delenv(var, raising=False)
        yield path


def _server(model: str, name: str) -> ServerThread:
    return ServerThread(ServerConfig(model=model, name=name, device="cpu",
                                     batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=500)))


def _mean(out: str, label: str) -> float:
    m = re.search(rf"^{re.escape(label)}: mean test accuracy ([0-9.]+)", out, re.M)
    assert m, out
    return float(m.group(1))


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_has_a_readme_with_measured_results(example: str) -> None:
    readme = (REPO / "examples" / example / "README.md").read_text()
    assert "--no_kd" in readme and "mean" in readme.lower(), f"examples/{example}/README.md lacks the comparison"
    assert (REPO / "examples" / example / "__init__.py").is_file()


def test_cv_scripts_train_export_serve_and_distil(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cv_teacher.main(["--smoke"]) == 0
    weights = cache / "cv" / "teacher.pt"
    assert weights.is_file() and (cache / "cv" / "teacher.json").is_file()
    state = torch.load(weights, weights_only=True)  # a plain state dict: loads without unpickling code
    assert "head.1.weight" in state

    assert cv_export.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "torchscript:" in out and "pt2:" in out and "matches the eager teacher" in out
    assert (cache / "cv" / "teacher.ts").is_file() and (cache / "cv" / "teacher.pt2").is_file()

    assert cv_serve.main(["--print", "--port", "9898"]) == 0
    assert "teacher-server --model examples.cv.teacher:build --name cv_teacher --device cpu --port 9898" in \
        capsys.readouterr().out
    # A real teacher-server subprocess serving the TorchScript file, checked against the eager teacher.
    assert cv_serve.main(["--smoke", "--from", "torchscript"]) == 0
    assert "64/64 predictions match" in capsys.readouterr().out

    with _server("examples.cv.teacher:build", cv_serve.MODEL_NAME) as srv:
        assert cv_student.main(["--smoke", "--distill_teachers", srv.url]) == 0
        kd = capsys.readouterr().out
    assert re.search(r"seed 0: KD student test accuracy [0-9.]+ \(120 samples", kd), kd
    assert 0.0 <= _mean(kd, "KD") <= 1.0
    assert cv_student.main(["--smoke", "--no_kd"]) == 0
    assert 0.0 <= _mean(capsys.readouterr().out, "no KD") <= 1.0


def test_cv_digits_are_scikit_learns_load_digits() -> None:
    """Read from the CSV in scikit-learn's wheel, without importing scikit-learn: ``load_digits()``'s
    images and targets (its 1,797 samples, per-class counts and the digest of both arrays)."""
    images, target = cv_data._digits()
    assert images.shape == (1797, 8, 8) and images.dtype.name == "float64" and target.dtype.name == "int64"
    assert target.tolist().count(0) == 178 and [int((target == c).sum()) for c in range(10)] == \
        [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert hashlib.sha256(images.tobytes() + target.tobytes()).hexdigest() == \
        "f6d9e39f37dc45d327f6db33428ee58970ccceabb2535a5c179de35886b70443"
    digits = cv_data.load()
    assert len(digits.test_y) == cv_data.TEST_SIZE and len(digits.train_y) == 1797 - cv_data.TEST_SIZE
    assert float(digits.train_x.max()) == 1.0 and float(digits.train_x.min()) == 0.0


def test_cv_student_needs_teachers_or_no_kd(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cv_student.main(["--smoke"])
    assert e.value.code == 2
    assert "--distill_teachers" in capsys.readouterr().err


def test_nlp_scripts_train_export_serve_and_distil_from_top_k(cache: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert nlp_teacher.main(["--smoke", "--sentences", "500"]) == 0
    assert (cache / "nlp" / "teacher.pt").is_file()
    assert nlp_export.main([]) == 0
    assert (cache / "nlp" / "teacher.pt2").is_file()
    capsys.readouterr()
    # The exported program behind a real teacher-server subprocess, asked for top-10 logits.
    assert nlp_serve.main(["--smoke", "--from", "pt2"]) == 0
    assert "top-10 logits [32, 10]" in capsys.readouterr().out

    with _server("examples.nlp.teacher:build", nlp_serve.MODEL_NAME) as srv:
        assert nlp_student.main(["--smoke", "--distill_teachers", srv.url, "--top_k", "10"]) == 0
        top = capsys.readouterr().out
        assert nlp_student.main(["--smoke", "--distill_teachers", srv.url, "--top_k", "0",
                                 "--output_dtype", "FP32"]) == 0
        full = capsys.readouterr().out
    assert 0.0 <= _mean(top, "KD top-10") <= 1.0
    assert 0.0 <= _mean(full, "KD full logits") <= 1.0


def test_nlp_student_reads_sparse_targets_from_top_k_outputs() -> None:
    values, indices = torch.randn(4, 10), torch.arange(10).repeat(4, 1)
    sparse = nlp_student.soft_targets({"LOGITS_TOPK_VALUES": values, "LOGITS_TOPK_INDICES": indices})
    assert sparse is not None and not isinstance(sparse, torch.Tensor) and sparse.k == 10
    full = torch.randn(4, 120)
    assert nlp_student.soft_targets({"LOGITS": full}) is full
    assert nlp_student.soft_targets(None) is None
