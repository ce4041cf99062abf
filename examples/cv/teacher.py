"""The served CV teacher: ``teacher-server --model examples.cv.teacher:build``.

``build()`` takes no arguments (the server calls it as is), so it finds the trained weights at
``weights_path()``: ``$DISTILL_CV_TEACHER`` if set, else ``<cache dir>/cv/teacher.pt`` where
``python -m examples.cv.train_teacher`` writes them. The module declares its tensors
(``io_spec``), so the server needs no ``--input/--output`` flags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from examples.common import TeacherFiles
from examples.cv.models import TeacherCNN

WEIGHTS_ENV = "DISTILL_CV_TEACHER"
FILES = TeacherFiles("cv", WEIGHTS_ENV, "CV")


def weights_path() -> Path:
    """Where the teacher's state dict is read from (and written to by default)."""
    return FILES.weights_path()


def info_path(weights: Path) -> Path:
    """The JSON summary next to the weights: test accuracy, epochs, seed (read by the demo's table)."""
    return FILES.info_path(weights)


def read_info(weights: Path | None = None) -> dict[str, Any]:
    """The training summary saved with the weights ({} if there is none)."""
    return FILES.read_info(weights)


def load_teacher(weights: str | os.PathLike[str] | None = None) -> TeacherCNN:
    """A ``TeacherCNN`` in eval mode with the trained weights (``ModelLoadError`` when there are none)."""
    return FILES.load(TeacherCNN(), weights)


def build() -> TeacherCNN:
    """The teacher-server factory: the trained teacher, with ``io_spec`` declaring its tensors."""
    return load_teacher()
