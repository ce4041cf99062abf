"""A store of teacher outputs keyed by sample: Arrow IPC shards, memory-mapped, append-only.

Layout of a store directory::

    PATH/store.json                  manifest: format version, namespace, key type (written once, atomically)
    PATH/shards/<seal_ns>-<writer>-<seq>.arrow   sealed shards, immutable, listed by readers
    PATH/tmp/<writer>-<seq>.arrow.partial        shards being written (or torn by a crash); never read

Why this shape (see docs/cache.md for the longer argument):

* Each writer (a student rank, a ``distill record`` process) writes its own shards, so no two
  processes ever write one file and no lock server is needed. A shard is written under ``tmp/``,
  fsynced, then renamed into ``shards/``: a rename is atomic, so a reader either sees a complete
  shard or none, and a writer killed mid-shard leaves only a ``.partial`` file that readers never
  open (``info()`` reports it; :meth:`TeacherOutputStore.remove_torn` deletes it).
* The shard name starts with the time it was sealed, so sorting names orders shards by sealing;
  a key stored twice (two students recorded the same sample) resolves to the first sealed copy,
  the same way in every process that sees the same shards.
* Reads memory-map the shard (a private, copy-on-write mapping) and build torch tensors directly
  on the mapped pages: no read, no copy for a contiguous run of rows, and a caller that writes
  into a returned tensor changes only its own private copy of the page, never the file.
* The index is three numpy arrays (sorted keys, segment, row), built at open with one
  ``np.unique`` over the shards' key columns; a lookup is one ``np.searchsorted``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import pyarrow as pa
import torch

from distill.cache.errors import (
    CacheError,
    NamespaceMismatchError,
    SchemaMismatchError,
    StoreClosedError,
    StoreNotFoundError,
)
from distill.cache.namespace import Namespace

__all__ = [
    "FORMAT_VERSION",
    "Lookup",
    "OutputSpec",
    "Ragged",
    "ShardWriter",
    "StoreInfo",
    "TeacherOutputStore",
    "UnsealedFile",
    "id_dtype",
]

FORMAT_NAME = "distill-teacher-outputs"
FORMAT_VERSION = 1
KEY_COLUMN = "__key__"
_META_NAMESPACE = b"distill.cache.namespace"
_META_FORMAT = b"distill.cache.format"
_META_KEY_TYPE = b"distill.cache.key_type"
_META_DTYPE = b"distill.dtype"
_META_SHAPE = b"distill.shape"
_MAX_KEY_BYTES = 65535  # bytes keys carry a 2-byte length in the index

KeyType = Literal["int64", "bytes"]
Mode = Literal["r", "a"]
# A fixed-shape output [N, ...]; or a variable-length one: N tensors [T_i, ...], or a Ragged (packed).
OutputValue = Union[torch.Tensor, np.ndarray, "Ragged", Sequence[Union[torch.Tensor, np.ndarray]]]  # noqa: UP007

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


@dataclass
class Ragged:
    """Variable-length outputs of several samples, packed without padding.

    ``values`` concatenates the samples along their first dimension (``[sum T_i, *item_shape]``);
    ``lengths[i]`` is sample i's ``T_i``. ``ragged[i]`` is a view of ``values``.
    """

    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        """``[n + 1]`` start offsets of each sample in ``values`` (int64)."""
        out = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i %= n
        start = int(self.lengths[:i].sum())
        return self.values[start : start + int(self.lengths[i])]

    def unbind(self) -> list[torch.Tensor]:
        """One view per sample."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def padded(self, pad_value: float = 0.0) -> torch.Tensor:
        """A ``[n, max T, *item_shape]`` copy padded with ``pad_value`` (for losses that want a dense batch)."""
        return torch.nn.utils.rnn.pad_sequence(self.unbind(), batch_first=True, padding_value=pad_value)


@dataclass
class Lookup:
    """The answer to :meth:`TeacherOutputStore.lookup`.

    ``hit[i]`` says whether the i-th asked key is stored; ``outputs`` holds the hits only, in the
    order they were asked (``hit_indices`` maps them back). A fixed-shape output is a tensor
    ``[n_hits, *shape]``, a variable-length one a :class:`Ragged`.
    """

    hit: np.ndarray
    outputs: dict[str, torch.Tensor | Ragged]

    @property
    def n_hits(self) -> int:
        return int(self.hit.sum())

    @property
    def all_hit(self) -> bool:
        return bool(self.hit.all())

    @property
    def hit_indices(self) -> np.ndarray:
        return np.flatnonzero(self.hit)

    @property
    def miss_indices(self) -> np.ndarray:
        """Positions of the keys to send to a teacher."""
        return np.flatnonzero(~self.hit)

    def tensor(self, name: str) -> torch.Tensor:
        """The fixed-shape output ``name`` as a ``[n_hits, *shape]`` tensor (typed access to ``outputs``)."""
        value = self.outputs[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"output {name!r} has a variable length per sample: use lookup.ragged({name!r})")
        return value

    def ragged(self, name: str) -> Ragged:
        """The variable-length output ``name`` as a :class:`Ragged` (typed access to ``outputs``)."""
        value = self.outputs[name]
        if not isinstance(value, Ragged):
            raise TypeError(f"output {name!r} has a fixed shape per sample: use lookup.tensor({name!r})")
        return value


@dataclass(frozen=True)
class UnsealedFile:
    """A shard file under ``tmp/``: being written, or torn by a writer that died before sealing it."""

    name: str
    bytes: int
    state: Literal["torn", "writing", "unknown"]
    reason: str


@dataclass
class StoreInfo:
    """What ``distill cache info`` prints."""

    path: str
    namespace: Namespace
    key_type: str
    outputs: list[OutputSpec]
    shards: list[tuple[str, int, int]]  # (name, rows, bytes), sealed and read
    samples: int
    rows: int
    bytes: int
    tokens: int | None
    unsealed: list[UnsealedFile] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        return self.rows - self.samples

    @property
    def bytes_per_sample(self) -> float | None:
        return self.bytes / self.rows if self.rows else None

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.tokens if self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "namespace": self.namespace.to_dict(),
            "key_type": self.key_type,
            "outputs": {s.name: s.describe() for s in self.outputs},
            "samples": self.samples,
            "rows": self.rows,
            "duplicates": self.duplicates,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "bytes_per_sample": self.bytes_per_sample,
            "bytes_per_token": self.bytes_per_token,
            "shards": [{"name": n, "rows": r, "bytes": b} for n, r, b in self.shards],
            "unsealed": [
                {"name": u.name, "bytes": u.bytes, "state": u.state, "reason": u.reason} for u in self.unsealed
            ],
            "rejected": [{"name": n, "reason": r} for n, r in self.rejected],
        }

    def render(self, max_shards: int = 20) -> str:
        ns = self.namespace
        lines = [
            f"store      {self.path}",
            f"teacher    {ns.model_name}" + (f" version {ns.model_version}" if ns.model_version else ""),
            f"namespace  outputs={','.join(ns.outputs) or '-'} dtype={ns.dtype} top_k={ns.top_k} "
            f"temperature={ns.temperature} values={ns.values}"
            + "".join(f" {k}={v}" for k, v in ns.extra),
            f"keys       {self.key_type}",
            "outputs    " + (", ".join(f"{s.name} {s.describe()}" for s in self.outputs) or "-"),
            f"samples    {self.samples:,}"
            + (f" ({self.duplicates:,} duplicate rows ignored)" if self.duplicates else ""),
            f"bytes      {self.bytes:,}",
            "per sample " + (f"{self.bytes_per_sample:,.1f} B" if self.bytes_per_sample is not None else "-"),
            "per token  "
            + (f"{self.bytes_per_token:,.2f} B ({self.tokens:,} tokens)" if self.bytes_per_token else "-"),
            f"shards     {len(self.shards)} sealed, {len(self.unsealed)} unsealed, {len(self.rejected)} rejected",
        ]
        for name, rows, nbytes in self.shards[:max_shards]:
            lines.append(f"  sealed    {name}  {rows:,} rows  {nbytes:,} B")
        if len(self.shards) > max_shards:
            lines.append(f"  ... {len(self.shards) - max_shards} more sealed shards")
        for u in self.unsealed:
            lines.append(f"  {u.state:<9} tmp/{u.name}  {u.bytes:,} B  ({u.reason})")
        for name, reason in self.rejected:
            lines.append(f"  rejected  {name}  ({reason})")
        return "\n".join(lines)


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


# ------------------------------------------------------------------------------------- segments


@dataclass
class _Segment:
    """One record batch of one sealed shard, with torch views of its columns."""

    shard: int
    keys: np.ndarray
    fixed: dict[str, torch.Tensor]  # name -> [rows, *shape]
    items: dict[str, torch.Tensor]  # name -> [n_items, *item_shape] (variable outputs)
    offsets: dict[str, np.ndarray]  # name -> [rows + 1] item offsets (variable outputs)


@dataclass
class _Shard:
    name: str
    nbytes: int
    rows: int
    tokens: int


def _tensor_over(values: pa.Array, spec: OutputSpec, mm: mmap.mmap, base: int, size: int) -> torch.Tensor:
    """A flat torch tensor over a primitive Arrow array: on the mapped pages when they are there."""
    n = len(values)
    dtype = spec.torch_dtype
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if values.null_count:
        raise CacheError(f"column {spec.name!r} has nulls: not written by distill.cache")
    buf = values.buffers()[1]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    start = buf.address + values.offset * itemsize
    if base <= start and start + n * itemsize <= base + size:
        return torch.frombuffer(mm, dtype=dtype, count=n, offset=start - base)  # zero-copy
    # Compressed shards decompress into Arrow's heap: one copy, into memory torch owns.
    raw = bytearray(memoryview(buf)[values.offset * itemsize : (values.offset + n) * itemsize])
    return torch.frombuffer(raw, dtype=dtype, count=n)


# ---------------------------------------------------------------------------------------- store


_WRITER_ID = re.compile(r"^(?P<host>[A-Za-z0-9_]+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]+)-(?P<seq>\d+)\.arrow\.partial$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TeacherOutputStore:
    """Teacher outputs keyed by sample, shared by many processes through a directory.

    Open with :meth:`open`; read with :meth:`lookup`; write with :meth:`writer`; see shards other
    processes sealed since with :meth:`refresh`. One instance may be read from several threads
    (a refresh swaps the index in one assignment); a writer belongs to one thread.
    """

    def __init__(self, path: Path, namespace: Namespace, key_type: KeyType, mode: Mode) -> None:
        self.path = path
        self.namespace = namespace
        self.key_type: KeyType = key_type
        self.mode: Mode = mode
        self._specs: dict[str, OutputSpec] | None = None
        self._shards: list[_Shard] = []
        self._segments: list[_Segment] = []
        self._seen: set[str] = set()
        self._rejected: dict[str, str] = {}
        # (sorted keys, segment of each, row of each, rows in all)
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray, int] = (
            np.zeros(0, dtype=np.int64 if key_type == "int64" else "S2"),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int64),
            0,
        )
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------------------- opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        namespace: Namespace | None = None,
        mode: Mode = "r",
        key_type: KeyType = "int64",
    ) -> TeacherOutputStore:
        """Open the store at ``path``.

        ``mode="r"`` reads an existing store; ``namespace`` may be left out to accept whatever the
        store holds (as ``distill cache info`` does), and is checked when given. ``mode="a"``
        creates the store if needed (``namespace`` required) and allows :meth:`writer`.
        ``key_type`` is ``"int64"`` (dataset indices) or ``"bytes"`` (hashes; ``str`` keys are
        UTF-8 encoded); it is fixed when the store is created.

        Raises :class:`NamespaceMismatchError` when the store was recorded with other settings and
        :class:`StoreNotFoundError` when reading a path that holds no store.
        """
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        if key_type not in ("int64", "bytes"):
            raise ValueError(f"key_type must be 'int64' or 'bytes', got {key_type!r}")
        root = Path(path)
        manifest = root / "store.json"
        if mode == "a":
            if namespace is None:
                raise ValueError("opening a store for appending needs the namespace of the outputs to be written")
            (root / "shards").mkdir(parents=True, exist_ok=True)
            (root / "tmp").mkdir(exist_ok=True)
            if not manifest.exists():
                cls._create_manifest(root, namespace, key_type)
        if not manifest.exists():
            raise StoreNotFoundError(
                f"no teacher-output store at {root} (no store.json): record one first, or open it with mode='a'"
            )
        try:
            doc = json.loads(manifest.read_text())
            stored_ns = Namespace.from_dict(doc["namespace"])
            stored_key_type = doc["key_type"]
        except (ValueError, KeyError, TypeError) as e:
            raise CacheError(
                f"{manifest} is not a readable store manifest ({e}); was it written by distill.cache?"
            ) from e
        if doc.get("format") != FORMAT_NAME or int(doc.get("version", 0)) > FORMAT_VERSION:
            raise CacheError(
                f"{manifest} has format {doc.get('format')!r} version {doc.get('version')}; this version of "
                f"distill reads {FORMAT_NAME!r} up to version {FORMAT_VERSION}: upgrade distill-mesh"
            )
        if namespace is not None:
            namespace.check_same(stored_ns, str(root))
        if mode == "a" and key_type != stored_key_type:
            raise NamespaceMismatchError(
                f"the store at {root} is keyed by {stored_key_type}, not {key_type}: open it with "
                f"key_type={stored_key_type!r} or use another path",
                ("key_type",),
            )
        store = cls(root, stored_ns, stored_key_type, mode)
        store.refresh()
        return store

    @staticmethod
    def _create_manifest(root: Path, namespace: Namespace, key_type: str) -> None:
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "namespace": namespace.to_dict(), "key_type": key_type}
        tmp = root / "tmp" / f"store.json.{os.getpid()}.{secrets.token_hex(4)}"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, root / "store.json")  # atomic create-if-absent: a racing creator keeps its own
            _fsync_dir(root)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()

    # ------------------------------------------------------------------------------- reading

    @property
    def output_specs(self) -> dict[str, OutputSpec]:
        """The stored outputs (empty until a shard is sealed)."""
        return dict(self._specs or {})

    def __len__(self) -> int:
        """Number of distinct samples stored (duplicates counted once)."""
        return len(self._index[0])

    def refresh(self) -> int:
        """Read shards sealed since the last refresh (by any process); returns how many were added.

        Shards are immutable once sealed, so only new names are opened. The index is rebuilt from
        the key arrays already in memory (one ``np.unique``) so that "first sealed wins" also holds
        when a shard sealed earlier shows up late.
        """
        self._check_open()
        with self._lock:
            shard_dir = self.path / "shards"
            names = sorted(n for n in os.listdir(shard_dir) if n.endswith(".arrow")) if shard_dir.exists() else []
            new = [n for n in names if n not in self._seen]
            added = 0
            for name in new:
                self._seen.add(name)
                try:
                    self._load_shard(name)
                    added += 1
                except (pa.ArrowException, OSError, ValueError, CacheError) as e:
                    self._rejected[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            if added:
                self._rebuild_index()
            return added

    def _load_shard(self, name: str) -> None:
        path = self.path / "shards" / name
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        whole = pa.py_buffer(mm)
        reader = pa.ipc.open_file(whole)
        schema = reader.schema
        meta = schema.metadata or {}
        if _META_NAMESPACE not in meta:
            raise CacheError("no namespace in the shard's metadata: not written by distill.cache")
        ns = Namespace.from_json(meta[_META_NAMESPACE])
        if ns != self.namespace:
            raise CacheError(f"namespace differs from the store's in {', '.join(self.namespace.diff(ns))}")
        if meta.get(_META_KEY_TYPE, b"").decode() != self.key_type:
            raise CacheError(f"keys are {meta.get(_META_KEY_TYPE, b'?').decode()}, the store's are {self.key_type}")
        specs = {f.name: OutputSpec.from_field(f) for f in schema if f.name != KEY_COLUMN}
        if self._specs is not None and specs != self._specs:
            raise CacheError(f"outputs {_describe(specs)} differ from the store's {_describe(self._specs)}")
        shard_index = len(self._shards)
        segments = []
        rows = tokens = 0
        base, size = whole.address, whole.size
        for i in range(reader.num_record_batches):
            rb = reader.get_batch(i)
            key_col = rb.column(KEY_COLUMN)
            keys = (
                key_col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
                if self.key_type == "int64"
                else _bytes_keys_to_index(key_col)
            )
            seg = _Segment(shard_index, keys, {}, {}, {})
            for spec in specs.values():
                col = rb.column(spec.name)
                if spec.variable:
                    offsets = col.offsets.to_numpy().astype(np.int64)
                    if np.any(offsets % spec.item_numel):
                        raise CacheError(
                            f"column {spec.name!r} has a sample that is not whole rows of {spec.item_shape}"
                        )
                    flat = _tensor_over(col.values, spec, mm, base, size)
                    seg.items[spec.name] = flat.view(-1, *spec.item_shape)
                    seg.offsets[spec.name] = offsets // spec.item_numel
                    if spec.name == next(s.name for s in specs.values() if s.variable):
                        tokens += int(seg.offsets[spec.name][-1] - seg.offsets[spec.name][0])
                else:
                    flat = _tensor_over(col.flatten(), spec, mm, base, size)
                    seg.fixed[spec.name] = flat.view(len(rb), *spec.shape)
            segments.append(seg)
            rows += len(rb)
        if self._specs is None:  # the first readable shard fixes what the store holds
            self._specs = specs
        self._segments.extend(segments)
        self._shards.append(_Shard(name, size, rows, tokens))

    def _rebuild_index(self) -> None:
        # Segments in shard-name order (= sealing order), rows in order: np.unique's first
        # occurrence is then the first sealed copy of each key.
        order = sorted(range(len(self._segments)), key=lambda i: (self._shards[self._segments[i].shard].name, i))
        if not order:
            return
        keys = np.concatenate([self._segments[i].keys for i in order])
        seg_ids = np.concatenate([np.full(len(self._segments[i].keys), i, dtype=np.int32) for i in order])
        rows = np.concatenate([np.arange(len(self._segments[i].keys), dtype=np.int64) for i in order])
        uniq, first = np.unique(keys, return_index=True)
        self._index = (uniq, seg_ids[first], rows[first], len(keys))

    def _find(self, keys: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hit mask, segment of each hit, row of each hit) for ``keys``, vectorised."""
        sorted_keys, seg_ids, rows, _ = self._index
        if self.key_type == "int64":
            q = _as_int_keys(keys)
            valid = np.ones(len(q), dtype=bool)
        else:
            raw = _as_bytes_list(keys)
            enc = _bytes_keys_to_index(pa.array(raw, type=pa.binary()))
            width = sorted_keys.dtype.itemsize
            valid = np.fromiter((len(b) + 2 <= width for b in raw), dtype=bool, count=len(raw))
            q = enc.astype(f"S{width}")  # only the invalid (longer than any stored key) ones are cut
        if len(sorted_keys) == 0 or len(q) == 0:
            return np.zeros(len(q), dtype=bool), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
        pos = np.searchsorted(sorted_keys, q)
        pos_c = np.minimum(pos, len(sorted_keys) - 1)
        hit = (sorted_keys[pos_c] == q) & valid
        return hit, seg_ids[pos_c[hit]], rows[pos_c[hit]]

    def contains(self, keys: Any) -> np.ndarray:
        """Boolean mask: which of ``keys`` are stored."""
        self._check_open()
        return self._find(keys)[0]

    def lookup(self, keys: Any, outputs: Sequence[str] | None = None) -> Lookup:
        """The stored outputs of ``keys`` (ints for an int64 store; bytes or str for a bytes store).

        Returns a :class:`Lookup`: the hit mask and, for the hits in asked order, each output.
        When the hits are consecutive rows of one shard (a dataset recorded and read in order),
        the tensors are views of the memory-mapped file (no copy); otherwise they are gathered
        into new tensors with one vectorised index per shard touched.
        """
        self._check_open()
        hit, seg_ids, rows = self._find(keys)
        specs = self._specs or {}
        names = list(specs) if outputs is None else list(outputs)
        unknown = [n for n in names if n not in specs]
        if unknown and (specs or hit.any()):
            raise KeyError(f"outputs {unknown} are not stored; this store holds {sorted(specs)}")
        out: dict[str, torch.Tensor | Ragged] = {}
        for name in names:
            if name in specs:
                out[name] = self._gather(specs[name], seg_ids, rows)
        return Lookup(hit, out)

    def _gather(self, spec: OutputSpec, seg_ids: np.ndarray, rows: np.ndarray) -> torch.Tensor | Ragged:
        n = len(rows)
        segs = self._segments
        if n == 0:
            empty = torch.empty((0, *spec.item_shape), dtype=spec.torch_dtype)
            return Ragged(empty, torch.zeros(0, dtype=torch.int64)) if spec.variable else empty.view(0, *spec.shape)
        # One stable sort groups the hits by segment; each group is then one vectorised index.
        order = np.argsort(seg_ids, kind="stable")
        cuts = np.flatnonzero(np.diff(seg_ids[order])) + 1
        groups = [(int(seg_ids[g[0]]), g) for g in np.split(order, cuts)]
        contiguous = len(groups) == 1 and (n == 1 or bool(np.all(np.diff(rows) == 1)))
        if not spec.variable:
            if contiguous:
                return segs[groups[0][0]].fixed[spec.name][int(rows[0]) : int(rows[-1]) + 1]
            work = _INDEXABLE.get(spec.torch_dtype, spec.torch_dtype)
            pieces = [
                segs[s].fixed[spec.name].view(work).index_select(0, torch.from_numpy(rows[pos])) for s, pos in groups
            ]
            return _in_order(pieces, [pos for _, pos in groups]).view(spec.torch_dtype)
        starts = np.empty(n, dtype=np.int64)
        lens = np.empty(n, dtype=np.int64)
        for s, pos in groups:
            off = segs[s].offsets[spec.name]
            r = rows[pos]
            starts[pos] = off[r]
            lens[pos] = off[r + 1] - off[r]
        lengths = torch.from_numpy(lens)
        if contiguous:
            items = segs[groups[0][0]].items[spec.name]
            return Ragged(items[int(starts[0]) : int(starts[0] + lens.sum())], lengths)
        out_starts = np.cumsum(lens) - lens
        work = _INDEXABLE.get(spec.torch_dtype, spec.torch_dtype)
        # Item ranges of all hits at once (in segment order), then cut per segment.
        src_all = _ranges(starts[order], lens[order])
        dst_all = _ranges(out_starts[order], lens[order])
        per_group = np.add.reduceat(lens[order], np.concatenate(([0], cuts))) if len(order) else lens[:0]
        bounds = np.cumsum(per_group)[:-1]
        pieces = [
            segs[s].items[spec.name].view(work).index_select(0, torch.from_numpy(src))
            for (s, _), src in zip(groups, np.split(src_all, bounds), strict=True)
        ]
        return Ragged(_in_order(pieces, np.split(dst_all, bounds)).view(spec.torch_dtype), lengths)

    # ------------------------------------------------------------------------------- writing

    def writer(
        self,
        shard_max_bytes: int = 256 << 20,
        shard_max_rows: int | None = None,
        compression: Literal["zstd", "lz4"] | None = None,
        batch_bytes: int = 16 << 20,
    ) -> ShardWriter:
        """A writer of this process's own shards (open the store with ``mode="a"``).

        A shard is sealed when it reaches ``shard_max_bytes`` or ``shard_max_rows``, on
        :meth:`ShardWriter.seal`, and on close. ``compression`` makes shards smaller but reads
        then decompress into memory instead of mapping the file (no zero-copy). Appended batches
        are buffered in memory up to ``batch_bytes`` and written as one Arrow record batch: readers
        index per record batch, so few large ones make random lookups cheaper than many small ones.
        """
        self._check_open()
        if self.mode != "a":
            raise CacheError(f"the store at {self.path} is open for reading; open it with mode='a' to write")
        return ShardWriter(self, shard_max_bytes, shard_max_rows, compression, batch_bytes)

    # ---------------------------------------------------------------------------------- info

    def unsealed(self) -> list[UnsealedFile]:
        """Files under ``tmp/``: shards being written, or torn by a writer that died (never read)."""
        tmp = self.path / "tmp"
        out: list[UnsealedFile] = []
        if not tmp.exists():
            return out
        for name in sorted(os.listdir(tmp)):
            if not name.endswith(".partial"):
                continue
            try:
                nbytes = (tmp / name).stat().st_size
            except FileNotFoundError:
                continue  # sealed (renamed away) while we listed
            m = _WRITER_ID.match(name)
            if m is None:
                out.append(UnsealedFile(name, nbytes, "unknown", "name not written by distill.cache"))
            elif m["host"] != _host():
                out.append(UnsealedFile(name, nbytes, "unknown", f"writer on host {m['host']}"))
            elif _pid_alive(int(m["pid"])):
                out.append(UnsealedFile(name, nbytes, "writing", f"writer pid {m['pid']} is running"))
            else:
                out.append(UnsealedFile(name, nbytes, "torn", f"writer pid {m['pid']} is gone; its samples are misses"))
        return out

    def remove_torn(self) -> list[str]:
        """Delete torn shards (their writer on this host is gone); returns their names."""
        removed = []
        for u in self.unsealed():
            if u.state == "torn":
                with contextlib.suppress(FileNotFoundError):
                    (self.path / "tmp" / u.name).unlink()
                removed.append(u.name)
        return removed

    def info(self) -> StoreInfo:
        """Namespace, samples, bytes, tokens and shards, as of the last :meth:`refresh`."""
        has_tokens = any(s.variable for s in (self._specs or {}).values())
        return StoreInfo(
            path=str(self.path),
            namespace=self.namespace,
            key_type=self.key_type,
            outputs=list((self._specs or {}).values()),
            shards=[(s.name, s.rows, s.nbytes) for s in self._shards],
            samples=len(self),
            rows=self._index[3],
            bytes=sum(s.nbytes for s in self._shards),
            tokens=sum(s.tokens for s in self._shards) if has_tokens else None,
            unsealed=self.unsealed(),
            rejected=sorted(self._rejected.items()),
        )

    # ------------------------------------------------------------------------------- closing

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.path} is closed; open it again")

    def close(self) -> None:
        """Drop this instance's maps; tensors already returned stay valid (they hold their own reference)."""
        self._closed = True
        self._segments = []
        self._index = (self._index[0][:0], self._index[1][:0], self._index[2][:0], 0)

    def __enter__(self) -> TeacherOutputStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(specs: Mapping[str, OutputSpec]) -> str:
    return "{" + ", ".join(f"{n}: {s.describe()}" for n, s in sorted(specs.items())) + "}"


def _in_order(pieces: list[torch.Tensor], dests: Sequence[np.ndarray]) -> torch.Tensor:
    """Rows gathered per segment, put back in asked order: ``out[dests[i][j]] = pieces[i][j]``.

    One concatenation and one ``index_select`` by the inverse permutation: torch's ``index_copy_``
    and indexed assignment are an order of magnitude slower for 16-bit dtypes on CPU.
    """
    if len(pieces) == 1 and bool(np.all(np.diff(dests[0]) == 1)):
        return pieces[0]
    whole = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    inverse = np.argsort(np.concatenate(dests), kind="stable")
    return whole.index_select(0, torch.from_numpy(inverse))


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, start + len)`` for each pair, without a Python loop."""
    total = int(lens.sum())
    before = np.cumsum(lens) - lens
    return np.repeat(starts - before, lens) + np.arange(total, dtype=np.int64)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------- writer


class ShardWriter:
    """Appends whole batches to this process's own shards and seals them atomically.

    Rows go to ``tmp/<writer>-<seq>.arrow.partial`` as Arrow IPC record batches; :meth:`seal`
    writes the file footer, fsyncs, and renames the file into ``shards/`` (then fsyncs the
    directory). A process killed before that leaves the ``.partial`` file, which no reader opens.
    Not thread-safe: one writer per thread.
    """

    def __init__(
        self,
        store: TeacherOutputStore,
        shard_max_bytes: int,
        shard_max_rows: int | None,
        compression: Literal["zstd", "lz4"] | None,
        batch_bytes: int = 16 << 20,
    ) -> None:
        self.store = store
        self.shard_max_bytes = shard_max_bytes
        self.shard_max_rows = shard_max_rows
        self.batch_bytes = batch_bytes
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._options = pa.ipc.IpcWriteOptions(compression=compression)
        self.writer_id = f"{_host()}.{os.getpid()}.{secrets.token_hex(4)}"
        self._seq = 0
        self._specs: dict[str, OutputSpec] | None = store.output_specs or None
        self._schema: pa.Schema | None = None
        self._sink: pa.NativeFile | None = None
        self._ipc: Any = None
        self._tmp: Path | None = None
        self._rows = 0
        self.sealed: list[Path] = []
        self._closed = False

    def append(self, keys: Any, outputs: Mapping[str, OutputValue]) -> None:
        """Append one batch: ``keys`` (N ints, or N bytes/str) and, per output, either a tensor
        ``[N, ...]`` or a list of N tensors ``[T_i, ...]`` (variable length, same trailing shape).

        Every batch must carry the same outputs with the same dtypes and per-sample shapes as the
        store holds. The batch is written to disk now, but readers see it only once its shard is sealed.
        """
        if self._closed:
            raise StoreClosedError("this shard writer is closed; make a new one with store.writer()")
        if self.store.key_type == "int64":
            key_arr = pa.array(_as_int_keys(keys), type=pa.int64())
        else:
            key_arr = pa.array(_as_bytes_list(keys), type=pa.binary())
        n = len(key_arr)
        if n == 0:
            return
        columns, specs = self._columns(n, outputs)
        if self._specs is None:
            self._specs = specs
        elif specs != self._specs:
            raise SchemaMismatchError(
                f"appended outputs {_describe(specs)} differ from the store's {_describe(self._specs)}: every batch "
                "must carry the same outputs, dtypes and per-sample shapes"
            )
        if self._ipc is None:
            self._start_shard()
        assert self._schema is not None and self._ipc is not None and self._sink is not None
        batch = pa.RecordBatch.from_arrays([key_arr, *columns], schema=self._schema)
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        self._rows += n
        if self._pending_bytes >= self.batch_bytes:
            self._flush()
        if self._sink.tell() + self._pending_bytes >= self.shard_max_bytes or (
            self.shard_max_rows is not None and self._rows >= self.shard_max_rows
        ):
            self.seal()

    def _columns(self, n: int, outputs: Mapping[str, OutputValue]) -> tuple[list[pa.Array], dict[str, OutputSpec]]:
        names = list(self._specs) if self._specs is not None else sorted(outputs)
        if set(names) != set(outputs):
            raise SchemaMismatchError(f"appended outputs {sorted(outputs)} differ from the store's {sorted(names)}")
        cols: list[pa.Array] = []
        specs: dict[str, OutputSpec] = {}
        for name in names:
            value = outputs[name]
            known = self._specs.get(name) if self._specs is not None else None
            if isinstance(value, (torch.Tensor, np.ndarray)) and not (known is not None and known.variable):
                t = torch.as_tensor(value).detach().cpu().contiguous()
                if t.ndim == 0 or t.shape[0] != n:
                    raise SchemaMismatchError(
                        f"output {name!r} has shape {tuple(t.shape)}; expected [{n}, ...] (one per key)"
                    )
                spec = OutputSpec(name, _dtype_name(t.dtype), tuple(t.shape[1:]))
                if spec.item_numel:
                    cols.append(pa.FixedSizeListArray.from_arrays(_arrow_values(t), spec.item_numel))
            else:
                values, lengths = _packed(name, n, value)
                spec = OutputSpec(name, _dtype_name(values.dtype), (-1, *values.shape[1:]))
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(lengths * spec.item_numel, out=offsets[1:])
                cols.append(pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), _arrow_values(values)))
            if spec.item_numel == 0:
                raise SchemaMismatchError(
                    f"output {name!r} has an empty per-sample shape {spec.shape}: nothing to store"
                )
            specs[name] = spec
        return cols, specs

    def _start_shard(self) -> None:
        assert self._specs is not None
        meta = {
            _META_NAMESPACE: self.store.namespace.to_json().encode(),
            _META_FORMAT: f"{FORMAT_NAME}/{FORMAT_VERSION}".encode(),
            _META_KEY_TYPE: self.store.key_type.encode(),
        }
        key_type = pa.int64() if self.store.key_type == "int64" else pa.binary()
        fields = [pa.field(KEY_COLUMN, key_type, nullable=False)] + [s.arrow_field() for s in self._specs.values()]
        self._schema = pa.schema(fields, metadata=meta)
        self._tmp = self.store.path / "tmp" / f"{self.writer_id}-{self._seq:06d}.arrow.partial"
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._ipc = pa.ipc.new_file(self._sink, self._schema, options=self._options)
        self._rows = 0

    def _flush(self) -> None:
        """Write the buffered batches to the shard file as one record batch."""
        if not self._pending:
            return
        batch = self._pending[0]
        if len(self._pending) > 1:
            (batch,) = pa.Table.from_batches(self._pending).combine_chunks().to_batches() or [batch]
        self._ipc.write_batch(batch)
        self._pending = []
        self._pending_bytes = 0

    def seal(self) -> Path | None:
        """Finish the current shard and make it visible to readers (atomically); returns its path."""
        if self._ipc is None:
            return None
        assert self._sink is not None and self._tmp is not None
        self._flush()
        self._ipc.close()
        self._sink.close()
        fd = os.open(self._tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        final = self.store.path / "shards" / f"{time.time_ns():020d}-{self.writer_id}-{self._seq:06d}.arrow"
        os.rename(self._tmp, final)
        _fsync_dir(final.parent)
        self._ipc = self._sink = self._tmp = None
        self._seq += 1
        self.sealed.append(final)
        return final

    def abort(self) -> None:
        """Drop the current shard unsealed (its rows are lost; readers never saw them)."""
        if self._ipc is not None:
            assert self._sink is not None and self._tmp is not None
            self._pending = []
            self._pending_bytes = 0
            with contextlib.suppress(Exception):
                self._ipc.close()
            self._sink.close()
            self._tmp.unlink(missing_ok=True)
            self._ipc = self._sink = self._tmp = None

    def close(self) -> None:
        """Seal what was appended; the writer cannot be used after."""
        if not self._closed:
            self.seal()
            self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Rows already appended are valid teacher outputs even when the caller failed later: seal them.
        self.close()


def _packed(name: str, n: int, value: OutputValue) -> tuple[torch.Tensor, np.ndarray]:
    """A variable-length output as (values packed along the first dim, per-sample lengths)."""
    if isinstance(value, Ragged):
        values = value.values.detach().cpu()
        lengths = value.lengths.detach().cpu().numpy().astype(np.int64)
        if len(lengths) != n or int(lengths.sum()) != values.shape[0] or (lengths < 0).any():
            raise SchemaMismatchError(
                f"output {name!r}: a Ragged of {len(lengths)} samples with lengths summing to {int(lengths.sum())} "
                f"and values of shape {tuple(values.shape)} does not fit {n} keys"
            )
        return values, lengths
    if isinstance(value, (torch.Tensor, np.ndarray)):  # [N, T, ...]: every sample has the same T
        t = torch.as_tensor(value).detach().cpu()
        if t.ndim < 2 or t.shape[0] != n:
            raise SchemaMismatchError(f"output {name!r} has shape {tuple(t.shape)}; expected [{n}, T, ...]")
        return t.reshape(n * t.shape[1], *t.shape[2:]), np.full(n, t.shape[1], dtype=np.int64)
    ts = [torch.as_tensor(x).detach().cpu() for x in value]
    if len(ts) != n:
        raise SchemaMismatchError(f"output {name!r} has {len(ts)} samples for {n} keys")
    if any(t.ndim == 0 for t in ts):
        raise SchemaMismatchError(f"variable-length output {name!r} needs samples of shape [T, ...]")
    trailing = {tuple(t.shape[1:]) for t in ts}
    dtypes = {t.dtype for t in ts}
    if len(trailing) != 1 or len(dtypes) != 1:
        raise SchemaMismatchError(
            f"variable-length output {name!r} mixes shapes {sorted(trailing)} / dtypes {dtypes}: "
            "only the first dimension may vary between samples"
        )
    lengths = np.fromiter((t.shape[0] for t in ts), dtype=np.int64, count=n)
    return torch.cat(ts), lengths


def _arrow_values(t: torch.Tensor) -> pa.Array:
    flat = t.reshape(-1).contiguous()
    if flat.dtype == torch.bfloat16:
        return pa.array(flat.view(torch.int16).numpy().view(np.uint16), type=pa.uint16())
    return pa.array(flat.numpy(), type=_DTYPES[_dtype_name(flat.dtype)][1])
