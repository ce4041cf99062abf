"""The served NLP teacher: ``teacher-server --model examples.nlp.teacher:build``.

``build()`` takes no arguments (the server calls it as is) and reads the trained weights from
``weights_path()``: ``$DISTILL_NLP_TEACHER`` if set, else ``<cache dir>/nlp/teacher.pt``, where
``python -m examples.nlp.train_teacher`` writes them. Tensors are declared by ``io_spec``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from examples.common import cache_dir
from examples.nlp.models import TransformerTeacher
from teacher_server.model import ModelLoadError

WEIGHTS_ENV = "DISTILL_NLP_TEACHER"


def weights_path() -> Path:
    """Where the teacher's state dict is read from (and written to by default)."""
    explicit = os.environ.get(WEIGHTS_ENV)
    return Path(explicit).expanduser() if explicit else cache_dir() / "nlp" / "teacher.pt"


def info_path(weights: Path) -> Path:
    """The JSON summary next to the weights (test accuracy, epochs, seed)."""
    return weights.with_suffix(".json")


def read_info(weights: Path | None = None) -> dict[str, Any]:
    """The training summary saved with the weights ({} if there is none)."""
    try:
        data: dict[str, Any] = json.loads(info_path(weights or weights_path()).read_text())
    except (OSError, ValueError):
        return {}
    return data


def load_teacher(weights: str | os.PathLike[str] | None = None) -> TransformerTeacher:
    """A ``TransformerTeacher`` in eval mode with the trained weights (``weights_only=True``: a
    weights file is data and must not be able to run code)."""
    path = Path(weights) if weights is not None else weights_path()
    if not path.is_file():
        raise ModelLoadError(
            f"no trained NLP teacher at {path}: run `python -m examples.nlp.train_teacher` first "
            f"(or point ${WEIGHTS_ENV} at a state dict)"
        )
    model = TransformerTeacher()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def build() -> TransformerTeacher:
    """The teacher-server factory: the trained teacher, with ``io_spec`` declaring its tensors."""
    return load_teacher()
