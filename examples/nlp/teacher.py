"""The served NLP teacher: ``teacher-server --model examples.nlp.teacher:build``.

``build()`` takes no arguments (the server calls it as is) and reads the trained weights from
``weights_path()``: ``$DISTILL_NLP_TEACHER`` if set, else ``<cache dir>/nlp/teacher.pt``, where
``python -m examples.nlp.train_teacher`` writes them. Tensors are declared by ``io_spec``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from examples.common import TeacherFiles
from examples.nlp.models import TransformerTeacher

WEIGHTS_ENV = "DISTILL_NLP_TEACHER"
FILES = TeacherFiles("nlp", WEIGHTS_ENV, "NLP")


def weights_path() -> Path:
    """Where the teacher's state dict is read from (and written to by default)."""
    return FILES.weights_path()


def info_path(weights: Path) -> Path:
    """The JSON summary next to the weights: test accuracy, epochs, seed (read by the demo's table)."""
    return FILES.info_path(weights)


def read_info(weights: Path | None = None) -> dict[str, Any]:
    """The training summary saved with the weights ({} if there is none)."""
    return FILES.read_info(weights)


def load_teacher(weights: str | os.PathLike[str] | None = None) -> TransformerTeacher:
    """A ``TransformerTeacher`` in eval mode with the trained weights (``ModelLoadError`` when there are none)."""
    return FILES.load(TransformerTeacher(), weights)


def build() -> TransformerTeacher:
    """The teacher-server factory: the trained teacher, with ``io_spec`` declaring its tensors."""
    return load_teacher()
