"""The LLM example's models: a teacher and a smaller student, both ``transformers`` Llama configs.

Defined by config (``LlamaConfig``) rather than by hand, so the models are ordinary Hugging Face
causal LMs: ``save_pretrained`` / ``from_pretrained`` directories that any ``transformers`` code
(and later the teacher server) loads. Sizes are chosen for CPU training in minutes; the student is
the same architecture, narrower and shallower. Embeddings are tied (input = output projection),
which at a 4k vocabulary saves a third of the parameters.
About 2.1M parameters for the teacher and 0.6M for the student at 4096 tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from examples.common import cache_dir

TEACHER_ENV = "DISTILL_LLM_TEACHER"

# (hidden, layers, heads, intermediate)
_SIZES: dict[str, tuple[int, int, int, int]] = {
    "teacher": (192, 3, 4, 512),
    "student": (96, 2, 4, 256),
    "teacher-smoke": (64, 2, 2, 128),
    "student-smoke": (32, 1, 2, 64),
}


def config(role: str, vocab_size: int, *, max_len: int = 512, pad_token_id: int | None = None,
           eos_token_id: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a role: ``teacher``, ``student``, or their ``-smoke`` versions."""
    if role not in _SIZES:
        raise ValueError(f"role must be one of {', '.join(_SIZES)}, got {role!r}")
    hidden, layers, heads, inter = _SIZES[role]
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=inter, max_position_embeddings=max_len,
        tie_word_embeddings=True, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
    )


def build(role: str, vocab_size: int, **kwargs: Any) -> LlamaForCausalLM:
    """A freshly initialised causal LM of a role (seed torch first for reproducible weights)."""
    return LlamaForCausalLM(config(role, vocab_size, **kwargs))


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def teacher_dir(*, smoke: bool = False) -> Path:
    """Where the trained teacher (model + tokenizer) lives: ``$DISTILL_LLM_TEACHER`` or ``<cache>/llm/teacher``."""
    explicit = os.environ.get(TEACHER_ENV)
    if explicit and not smoke:
        return Path(explicit).expanduser()
    return cache_dir() / "llm" / ("teacher-smoke" if smoke else "teacher")


def load_teacher(path: str | Path | None = None, *, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The trained teacher in eval mode, from a local ``save_pretrained`` directory (no hub access)."""
    directory = Path(path) if path is not None else teacher_dir()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"no trained LLM teacher at {directory}: run `python -m examples.llm.train_teacher` first "
            f"(or point ${TEACHER_ENV} at a save_pretrained directory)"
        )
    model = LlamaForCausalLM.from_pretrained(str(directory), local_files_only=True)
    torch.nn.Module.to(model, device)  # in place (the typed PreTrainedModel.to wrapper trips mypy)
    return model.eval()
