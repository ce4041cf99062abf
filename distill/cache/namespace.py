"""The namespace of a teacher-output store: who produced the outputs and how they were transformed.

Two stores hold interchangeable outputs only if every field here agrees, so every setting that
changes the numbers (the model and its version, which outputs, their dtype, top-k, temperature,
whether values are logits or log-probabilities) is a field. Anything else that changes outputs
(a tokenizer revision, a prompt template) goes into ``extra`` rather than being left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from distill.cache.errors import NamespaceMismatchError

__all__ = ["VALUE_KINDS", "Namespace"]

VALUE_KINDS = ("logits", "logprobs", "probs")


@dataclass(frozen=True)
class Namespace:
    """Identity of a teacher and every transform applied to its outputs before they were stored.

    ``model_version`` is a string so that "1", a git hash or a checkpoint digest all fit; use the
    empty string only when the teacher really has no version. ``top_k`` and ``temperature`` are
    ``None`` when the outputs are dense or untempered.
    """

    model_name: str
    model_version: str = ""
    outputs: tuple[str, ...] = ()
    dtype: str = "float32"
    top_k: int | None = None
    temperature: float | None = None
    values: str = "logits"
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("Namespace.model_name must name the teacher model")
        # Accept lists and dicts from callers but store tuples, so the dataclass stays hashable.
        object.__setattr__(self, "outputs", tuple(str(o) for o in self.outputs))
        extra: Any = self.extra
        items = extra.items() if isinstance(extra, dict) else extra
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in items)))
        if self.values not in VALUE_KINDS:
            raise ValueError(f"Namespace.values must be one of {VALUE_KINDS}, got {self.values!r}")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"Namespace.top_k must be positive or None, got {self.top_k}")
        if self.temperature is not None:
            object.__setattr__(self, "temperature", float(self.temperature))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return {
            "model_name": self.model_name,
            "model_version": self.model_version,
            "outputs": list(self.outputs),
            "dtype": self.dtype,
            "top_k": self.top_k,
            "temperature": self.temperature,
            "values": self.values,
            "extra": [list(kv) for kv in self.extra],
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), stored in the manifest and in every shard's schema metadata."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Namespace:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown namespace fields {unknown}: the store was written by a newer version")
        kw = dict(d)
        kw["outputs"] = tuple(kw.get("outputs", ()))
        kw["extra"] = tuple(tuple(kv) for kv in kw.get("extra", ()))
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str | bytes) -> Namespace:
        return cls.from_dict(json.loads(text))

    def diff(self, other: Namespace) -> tuple[str, ...]:
        """Names of the fields whose values differ between ``self`` and ``other``."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))

    def check_same(self, stored: Namespace, where: str) -> None:
        """Raise :class:`NamespaceMismatchError` naming each differing field, unless ``stored`` equals ``self``."""
        differ = self.diff(stored)
        if not differ:
            return
        parts = ", ".join(f"{f}: store has {getattr(stored, f)!r}, asked for {getattr(self, f)!r}" for f in differ)
        raise NamespaceMismatchError(
            f"the teacher-output store at {where} was recorded with other settings ({parts}); outputs of "
            "different teachers or settings must not mix: use another path for these settings, or open this "
            "store with the namespace it was recorded with (`distill cache info PATH` prints it)",
            differ,
        )
