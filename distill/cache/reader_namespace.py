"""What a reader's options and its teacher's metadata make of a teacher-output store: the namespace
its answers carry, the check of a store's namespace when no teacher is asked, which outputs have a
length per sample, and the dtype top-k ids are stored in.

Used by ``distill.cache.reader_side`` when it opens a store for a reader; plain functions of the
options, the metadata and the store's manifest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from distill.cache.errors import CacheError, NamespaceMismatchError
from distill.cache.format import id_dtype
from distill.cache.namespace import Namespace
from distill.options import ReaderOptions
from distill.outputs import base_output, derived_names, ids_output
from distill.types import TeacherMetadata

__all__ = ["check_options", "id_dtypes", "key_type_of", "per_position", "reader_namespace", "teacher_mismatch"]


def reader_namespace(options: ReaderOptions, meta: TeacherMetadata) -> Namespace:
    """The namespace of what this reader receives from a teacher serving `meta`: its model name and
    version, the outputs asked for, and the fields naming every output setting (dtype, top-k, value
    transforms: ``ReaderOptions.store_fields``; see docs/cache.md)."""
    outputs = tuple(options.outputs) if options.outputs else tuple(sorted(meta.outputs))
    return Namespace(model_name=meta.model_name, model_version=options.model_version or meta.model_version,
                     outputs=outputs, **options.store_fields())


def check_options(options: ReaderOptions, stored: Namespace, where: str) -> None:
    """Without a teacher to ask, the store's own namespace must agree with every output setting the
    reader was given (model, version, outputs, dtype, top-k, logprobs, temperature, tail)."""
    asked: dict[str, Any] = options.store_fields()
    if options.model:
        asked["model_name"] = options.model
    if options.model_version:
        asked["model_version"] = options.model_version
    if options.outputs:
        asked["outputs"] = tuple(options.outputs)
    asked["extra"] = tuple(sorted(asked["extra"]))
    differ = tuple(f for f, v in asked.items() if getattr(stored, f) != v)
    if differ:
        parts = ", ".join(f"{f}: store has {getattr(stored, f)!r}, asked for {asked[f]!r}" for f in differ)
        raise NamespaceMismatchError(
            f"the teacher-output store at {where} was recorded with other settings ({parts}): pass the reader the "
            "settings the store was recorded with (`distill cache info PATH` prints them), or another cache path",
            differ,
        )


def teacher_mismatch(options: ReaderOptions, stored: Namespace, meta: TeacherMetadata) -> str | None:
    """Why a teacher serving `meta` must not answer for a store of namespace `stored` (what it
    answers this reader would be named otherwise); None when it may."""
    asked = reader_namespace(options, meta)
    differ = asked.diff(stored)
    if not differ:
        return None
    return ("its answers would not match the teacher-output store's (" + ", ".join(
        f"{f}: store has {getattr(stored, f)!r}, this teacher gives {getattr(asked, f)!r}" for f in differ) + ")")


def per_position(ns: Namespace, meta: TeacherMetadata) -> tuple[frozenset[str], tuple[str, ...] | None]:
    """(outputs with a length per sample, inputs that carry that length) from the teacher's
    metadata: a teacher with inputs of open length ([-1, ...] per sample) pads them per batch, and
    its outputs of open length ([-1, ...]) follow the inputs' positions. A top-k output
    (<OUT>_TOPK_VALUES, _INDICES and the _TAIL mass) is per-position when <OUT> is."""
    seq_inputs = tuple(n for n, t in meta.inputs.items() if t.shape[:1] == (-1,))
    if not seq_inputs:
        return frozenset(), None
    variable = set()
    for name in ns.outputs:
        for stored in derived_names(name):
            out = meta.outputs.get(base_output(stored))
            if out is not None and out.shape[:1] == (-1,):
                variable.add(stored)
    return frozenset(variable), seq_inputs


def id_dtypes(ns: Namespace, meta: TeacherMetadata) -> dict[str, torch.dtype]:
    """The stored dtype of each top-k ids output whose vocabulary (the last dimension of the
    teacher's full output) fits int16 or uint16: 2 bytes an id instead of the 4 the teacher sends,
    a third of a top-k store. Read back as int32, so stored and live ids look alike."""
    if ns.top_k is None:
        return {}
    out: dict[str, torch.dtype] = {}
    for name in ns.outputs:
        stored = ids_output(name)
        full = meta.outputs.get(base_output(stored))
        if full is not None and full.shape and full.shape[-1] > 0:
            dtype = id_dtype(full.shape[-1])
            if dtype in (torch.int16, torch.uint16):
                out[stored] = dtype
    return out


def key_type_of(path: str) -> Any:
    """The key type of an existing store, from its manifest (so a bytes-keyed store opens); None
    when there is no store yet."""
    manifest = Path(path) / "store.json"
    try:
        doc = json.loads(manifest.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CacheError(f"{manifest} is not a readable store manifest ({e}); was it written by distill.cache?") from e
    key_type = doc.get("key_type") if isinstance(doc, dict) else None
    if key_type not in ("int64", "bytes"):
        raise CacheError(f"{manifest} names no key type (int64 or bytes); was it written by distill.cache?")
    return key_type
