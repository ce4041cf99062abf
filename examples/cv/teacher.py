"""The served CV teacher: ``teacher-server --model examples.cv.teacher:build``.

``build()`` takes no arguments (the server calls it as is), so it finds the trained weights at
``weights_path()``: ``$DISTILL_CV_TEACHER`` if set, else ``<cache dir>/cv/teacher.pt`` where
``python -m examples.cv.train_teacher`` writes them. The module declares its tensors
(``io_spec``), so the server needs no ``--input/--output`` flags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from examples.common import cache_dir
from examples.cv.models import TeacherCNN
from teacher_server.model import ModelLoadError

WEIGHTS_ENV = "DISTILL_CV_TEACHER"


def weights_path() -> Path:
    """Where the teacher's state dict is read from (and written to by default)."""
    explicit = os.environ.get(WEIGHTS_ENV)
    return Path(explicit).expanduser() if explicit else cache_dir() / "cv" / "teacher.pt"


def info_path(weights: Path) -> Path:
    """The JSON next to the weights: test accuracy, epochs, seed (read by the demo's table)."""
    return weights.with_suffix(".json")


def read_info(weights: Path | None = None) -> dict[str, Any]:
    """The training summary saved with the weights ({} if there is none)."""
    path = info_path(weights or weights_path())
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data


def load_teacher(weights: str | os.PathLike[str] | None = None) -> TeacherCNN:
    """A ``TeacherCNN`` in eval mode with the trained weights.

    ``torch.load(weights_only=True)``: a weights file is data, and loading it must not be able to
    run code, whoever wrote the cache directory.
    """
    path = Path(weights) if weights is not None else weights_path()
    if not path.is_file():
        raise ModelLoadError(
            f"no trained CV teacher at {path}: run `python -m examples.cv.train_teacher` first "
            f"(or point ${WEIGHTS_ENV} at a state dict)"
        )
    model = TeacherCNN()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def build() -> TeacherCNN:
    """The teacher-server factory: the trained teacher, with ``io_spec`` declaring its tensors."""
    return load_teacher()
