"""The on-disk format of a teacher-output store: names, metadata keys, dtypes, output specs, keys.

Everything here is shared by the reading side (:mod:`distill.cache.shards`,
:mod:`distill.cache.store`) and the writing side (:mod:`distill.cache.writer`): what a shard's
schema and metadata hold, how a torch dtype is stored in Arrow, how keys become the index's
numpy arrays, and how the files under ``tmp/`` are named. The layout itself is described in
:mod:`distill.cache.store` and docs/cache.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from distill.cache.errors import CacheError, SchemaMismatchError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "KEY_COLUMN", "SHARD_FORMAT_VERSION", "KeyType", "Mode", "OutputSpec",
           "id_dtype"]

FORMAT_NAME = "distill-teacher-outputs"
FORMAT_VERSION = 1  # store.json's: the directory layout, unchanged since the first version
# A shard's own (its schema's distill.cache.format): 2 carries checksums (distill.cache.integrity);
# 1 has none and is read unverified. Readers of version 1 read version 2 shards too.
SHARD_FORMAT_VERSION = 2
KEY_COLUMN = "__key__"
_META_NAMESPACE = b"distill.cache.namespace"
_META_FORMAT = b"distill.cache.format"
_META_SCHEMA_CRC = b"distill.cache.schema_crc32"  # schema metadata: CRC-32 of the schema's own description
_META_RECORDS = b"distill.cache.record_crc32"  # a record batch's metadata: [[rows, CRC-32], ...] per record
_META_KEY_TYPE = b"distill.cache.key_type"
# A shard's schema: {service: fingerprint} of the teachers whose answers it holds (one per service:
# a change of teacher starts a new shard); absent when they stated none (teacher_server.fingerprint).
_META_FINGERPRINTS = b"distill.cache.teacher_fingerprints"
_META_DTYPE = b"distill.dtype"
_META_SHAPE = b"distill.shape"
_MAX_KEY_BYTES = 65535  # bytes keys carry a 2-byte length in the index

KeyType = Literal["int64", "bytes"]
Mode = Literal["r", "a"]


# dtype name -> (torch dtype, arrow storage type). bfloat16 is not a numpy or Arrow type: it is
# stored as its raw 16 bits (uint16) and the field's metadata says how to view them back.
_DTYPES: dict[str, tuple[torch.dtype, pa.DataType]] = {
    "float32": (torch.float32, pa.float32()),
    "float16": (torch.float16, pa.float16()),
    "bfloat16": (torch.bfloat16, pa.uint16()),
    "float64": (torch.float64, pa.float64()),
    "int64": (torch.int64, pa.int64()),
    "int32": (torch.int32, pa.int32()),
    "int16": (torch.int16, pa.int16()),
    "int8": (torch.int8, pa.int8()),
    "uint8": (torch.uint8, pa.uint8()),
    # Token ids of vocabularies up to 65,536 (GPT-2's 50,257 does not fit int16). torch cannot index
    # uint16 tensors, so gathers run on an int16 view of the same bits.
    "uint16": (torch.uint16, pa.uint16()),
}
_INDEXABLE = {torch.uint16: torch.int16}
_TORCH_TO_NAME = {td: name for name, (td, _) in _DTYPES.items()}


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype that holds token ids below ``vocab_size``: int16, then uint16, then int32.

    Top-k ids are most of a sparse output's bytes (k ids per token next to k 16-bit values), so
    storing them in 2 bytes instead of 4 cuts a store by a third.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 15:
        return torch.int16
    if vocab_size <= 1 << 16:
        return torch.uint16
    if vocab_size <= 1 << 31:
        return torch.int32
    return torch.int64


def _dtype_name(dtype: torch.dtype) -> str:
    name = _TORCH_TO_NAME.get(dtype)
    if name is None:
        raise SchemaMismatchError(f"dtype {dtype} cannot be stored; use one of {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class OutputSpec:
    """One stored output: its dtype and per-sample shape (``-1`` first when the length varies per sample)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def variable(self) -> bool:
        """True when each sample has its own first dimension (``[T_i, k]``), stored without padding."""
        return len(self.shape) > 0 and self.shape[0] == -1

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one row of a sample's output: ``shape[1:]`` for variable outputs, else ``shape``."""
        return self.shape[1:] if self.variable else self.shape

    @property
    def item_numel(self) -> int:
        return int(np.prod(self.item_shape, dtype=np.int64)) if self.item_shape else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    def describe(self) -> str:
        dims = ", ".join("T" if d == -1 else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"

    def arrow_field(self) -> pa.Field:
        storage = _DTYPES[self.dtype][1]
        typ = pa.large_list(storage) if self.variable else pa.list_(storage, self.item_numel)
        meta = {_META_DTYPE: self.dtype.encode(), _META_SHAPE: json.dumps(list(self.shape)).encode()}
        return pa.field(self.name, typ, nullable=False, metadata=meta)

    @classmethod
    def from_field(cls, f: pa.Field) -> OutputSpec:
        meta = f.metadata or {}
        if _META_DTYPE not in meta or _META_SHAPE not in meta:
            raise CacheError(f"column {f.name!r} carries no dtype/shape metadata: not written by distill.cache")
        dtype = meta[_META_DTYPE].decode()
        if dtype not in _DTYPES:
            raise CacheError(f"column {f.name!r} has dtype {dtype!r}, which this version cannot read")
        return cls(f.name, dtype, tuple(int(d) for d in json.loads(meta[_META_SHAPE])))



def _describe(specs: Mapping[str, OutputSpec]) -> str:
    return "{" + ", ".join(f"{n}: {s.describe()}" for n, s in sorted(specs.items())) + "}"


# ----------------------------------------------------------------------------------------- keys


def _bytes_keys_to_index(arr: pa.Array) -> np.ndarray:
    """Arrow binary keys -> fixed-width numpy bytes (``S{w}``), vectorised.

    Each key is prefixed with its 2-byte big-endian length: numpy's ``S`` type drops trailing
    NUL bytes, so without the length ``b"a"`` and ``b"a\\0"`` would compare equal.
    """
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype="S2")
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    lens = np.diff(offsets)
    width = 2 + int(lens.max())
    out = np.zeros((n, width), dtype=np.uint8)
    out[:, 0] = lens >> 8
    out[:, 1] = lens & 0xFF
    total = int(offsets[-1] - offsets[0])
    if total:
        data = np.frombuffer(bufs[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
        rows = np.repeat(np.arange(n), lens)
        cols = 2 + np.arange(total) - np.repeat(offsets[:-1] - offsets[0], lens)
        out[rows, cols] = data
    return out.view(f"S{width}").reshape(n)


def _as_bytes_list(keys: Iterable[Any]) -> list[bytes]:
    out = []
    for k in keys:
        b = k.encode() if isinstance(k, str) else bytes(k)
        if len(b) > _MAX_KEY_BYTES:
            raise ValueError(f"a bytes key is {len(b)} bytes long; keys are limited to {_MAX_KEY_BYTES} (use a hash)")
        out.append(b)
    return out


def _as_int_keys(keys: Any) -> np.ndarray:
    if isinstance(keys, torch.Tensor):
        keys = keys.detach().cpu().numpy()
    arr = np.asarray(keys)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"this store's keys are int64; got keys of dtype {arr.dtype} (pass integer sample indices)")
    return arr.astype(np.int64, copy=False).reshape(-1)



# ---------------------------------------------------------------------------------------- files


_WRITER_ID = re.compile(r"^(?P<host>[A-Za-z0-9_]+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]+)-(?P<seq>\d+)\.arrow\.partial$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
