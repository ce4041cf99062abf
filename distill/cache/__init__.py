"""``distill.cache``: a store of teacher outputs keyed by sample, so a teacher answers each sample once.

A training run (or ``distill record``) writes what the teachers answered, keyed by a field of the
batch (a dataset index, a content hash); later epochs and later runs read it back instead of
asking a teacher. The store's namespace names the teacher and every transform of its outputs, so
outputs of different teachers or settings never mix::

    from distill.cache import Namespace, TeacherOutputStore

    ns = Namespace("llama-teacher", model_version="3", outputs=("VALUES", "IDS"), dtype="bfloat16",
                   top_k=32, temperature=1.0, values="logprobs")
    with TeacherOutputStore.open("/data/kd-cache", ns, mode="a") as store, store.writer() as w:
        w.append(batch["index"], {"VALUES": values_per_sample, "IDS": ids_per_sample})
    found = TeacherOutputStore.open("/data/kd-cache", ns).lookup(batch["index"])
    found.hit, found.outputs["VALUES"]      # mask, and the hits' outputs as torch tensors

    from distill.cache import record        # fill a store from a loader through the teachers (resumable)
    record(loader, cache="/data/kd-cache", teachers="10.0.0.7:8001", inputs=["X"], key="index")

Shards are Arrow IPC files, memory-mapped on read (see docs/cache.md). ``pyarrow`` comes with the
``cache`` extra: ``pip install 'distill-mesh[cache]'``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use, so that `distill cache --help` (and `import distill.cache.cli` from the
# `distill` command) costs nothing, and a missing pyarrow is reported when the store is used.
_EXPORTS = {
    "CacheError": "distill.cache.errors",
    "CacheMissError": "distill.cache.reader_side",
    "DamagedRecordError": "distill.cache.errors",
    "DamagedShardError": "distill.cache.errors",
    "DamagedRecord": "distill.cache.values",
    "Verification": "distill.cache.values",
    "NamespaceMismatchError": "distill.cache.errors",
    "SchemaMismatchError": "distill.cache.errors",
    "StoreClosedError": "distill.cache.errors",
    "StoreNotFoundError": "distill.cache.errors",
    "Namespace": "distill.cache.namespace",
    "Lookup": "distill.cache.values",
    "OutputSpec": "distill.cache.format",
    "Ragged": "distill.cache.values",
    "ShardWriter": "distill.cache.writer",
    "StoreInfo": "distill.cache.values",
    "TeacherOutputStore": "distill.cache.store",
    "UnsealedFile": "distill.cache.values",
    "id_dtype": "distill.cache.format",
    "LoaderContractError": "distill.cache.recording",
    "RecordResult": "distill.cache.recording",
    "record": "distill.cache.recording",
}

if TYPE_CHECKING:
    from distill.cache.errors import (
        CacheError,
        DamagedRecordError,
        DamagedShardError,
        NamespaceMismatchError,
        SchemaMismatchError,
        StoreClosedError,
        StoreNotFoundError,
    )
    from distill.cache.format import OutputSpec, id_dtype
    from distill.cache.namespace import Namespace
    from distill.cache.reader_side import CacheMissError
    from distill.cache.recording import LoaderContractError, RecordResult, record
    from distill.cache.store import TeacherOutputStore
    from distill.cache.values import DamagedRecord, Lookup, Ragged, StoreInfo, UnsealedFile, Verification
    from distill.cache.writer import ShardWriter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distill.cache' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name == "pyarrow":
            raise ModuleNotFoundError(
                "distill.cache needs pyarrow: pip install 'distill-mesh[cache]'", name="pyarrow"
            ) from e
        raise
    globals()[name] = value
    return value


__all__ = [
    "CacheError",
    "CacheMissError",
    "DamagedRecord",
    "DamagedRecordError",
    "DamagedShardError",
    "LoaderContractError",
    "Lookup",
    "Namespace",
    "NamespaceMismatchError",
    "OutputSpec",
    "Ragged",
    "RecordResult",
    "SchemaMismatchError",
    "ShardWriter",
    "StoreClosedError",
    "StoreInfo",
    "StoreNotFoundError",
    "TeacherOutputStore",
    "UnsealedFile",
    "Verification",
    "id_dtype",
    "record",
]
