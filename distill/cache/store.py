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
* Each record (the rows of one append) carries a CRC-32, verified the first time a lookup
  touches it (:mod:`distill.cache.integrity`); a damaged record is never served
  (:class:`DamagedRecordError`, or a miss to recompute), and :meth:`TeacherOutputStore.verify`
  checks a whole store.

This module opens the store, keeps its index and answers lookups; the format's names, dtypes
and key handling are in :mod:`distill.cache.format`, the returned types in
:mod:`distill.cache.values`, shard mapping and row gathering in :mod:`distill.cache.shards`,
and the writer in :mod:`distill.cache.writer`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from distill.cache.damage import Damage
from distill.cache.errors import (
    CacheError,
    DamagedRecordError,
    DamagedShardError,
    NamespaceMismatchError,
    StoreClosedError,
    StoreNotFoundError,
    damaged_message,
)
from distill.cache.format import (
    _WRITER_ID,
    FORMAT_NAME,
    FORMAT_VERSION,
    KeyType,
    Mode,
    OutputSpec,
    _as_bytes_list,
    _as_int_keys,
    _bytes_keys_to_index,
    _fsync_dir,
    _host,
    _pid_alive,
    id_dtype,
)
from distill.cache.namespace import Namespace
from distill.cache.shards import _Segment, _Shard, gather, read_shard
from distill.cache.values import Lookup, Ragged, StoreInfo, UnsealedFile, Verification
from distill.cache.writer import ShardWriter

# The value types, the writer and the format's names live in their own modules; they are
# re-exported here so that ``from distill.cache.store import X`` keeps working.
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
        self._damage = Damage(path)
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

    @property
    def damaged_shards(self) -> list[str]:
        """Shards not read because their file structure is damaged (in memory: no file access)."""
        return sorted(self._damage.shards)

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
                except (pa.ArrowException, OSError, ValueError, CacheError, IndexError, KeyError, TypeError) as e:
                    self._rejected[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                    if isinstance(e, DamagedShardError):
                        self._damage.shard(name, e)
            if added:
                self._damage.loaded(self._segments, self._shards)
                self._rebuild_index()
            return added

    def _load_shard(self, name: str) -> None:
        specs, segments, shard = read_shard(
            self.path / "shards" / name, self.namespace, self.key_type, self._specs, len(self._shards)
        )
        if self._specs is None:  # the first readable shard fixes what the store holds
            self._specs = specs
        self._segments.extend(segments)
        self._shards.append(shard)

    def _rebuild_index(self) -> None:
        # Segments in shard-name order (= sealing order), rows in order: np.unique's first
        # occurrence is then the first sealed copy of each key.
        order = sorted(range(len(self._segments)), key=lambda i: (self._shards[self._segments[i].shard].name, i))
        if not order:
            return
        # Rows of damaged records are left out (``alive``), so that another copy of their keys is served.
        segs = [self._segments[i] for i in order]
        live = [np.arange(len(s.keys), dtype=np.int64) if s.alive is None else np.flatnonzero(s.alive) for s in segs]
        keys = np.concatenate([s.keys if s.alive is None else s.keys[r] for s, r in zip(segs, live, strict=True)])
        seg_ids = np.concatenate([np.full(len(r), i, dtype=np.int32) for i, r in zip(order, live, strict=True)])
        rows = np.concatenate(live)
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
        """Boolean mask: which of ``keys`` are stored (their records are verified by :meth:`lookup`, not here)."""
        self._check_open()
        return self._find(keys)[0]

    def lookup(self, keys: Any, outputs: Sequence[str] | None = None,
               damaged: Literal["raise", "miss"] = "raise") -> Lookup:
        """The stored outputs of ``keys`` (ints for an int64 store; bytes or str for a bytes store).

        Returns a :class:`Lookup`: the hit mask and, for the hits in asked order, each output.
        When the hits are consecutive rows of one shard (a dataset recorded and read in order),
        the tensors are views of the memory-mapped file (no copy); otherwise they are gathered
        into new tensors with one vectorised index per shard touched.

        Each record a lookup touches is verified against its checksum the first time (see
        :mod:`distill.cache.integrity`). A damaged record is taken out of the index and never
        served: its keys are read from another stored copy when there is one, else
        ``damaged="raise"`` raises :class:`DamagedRecordError` naming the shard and the keys, and
        ``damaged="miss"`` returns them as misses, listed in ``Lookup.damaged`` (to be recomputed).
        """
        self._check_open()
        if damaged not in ("raise", "miss"):
            raise ValueError(f"damaged must be 'raise' or 'miss', got {damaged!r}")
        hit, seg_ids, rows = self._find(keys)
        while self._damage.unverified and len(rows) and self._take_out(
                self._damage.verify(self._segments, seg_ids, rows)):
            hit, seg_ids, rows = self._find(keys)  # without the damaged records: other copies, or misses
        lost = self._damage.asked(self.key_type, keys, hit)
        if lost and damaged == "raise":
            raise DamagedRecordError(damaged_message(str(self.path), lost), lost)
        specs = self._specs or {}
        names = list(specs) if outputs is None else list(outputs)
        unknown = [n for n in names if n not in specs]
        if unknown and (specs or hit.any()):
            raise KeyError(f"outputs {unknown} are not stored; this store holds {sorted(specs)}")
        out: dict[str, torch.Tensor | Ragged] = {}
        for name in names:
            if name in specs:
                out[name] = self._gather(specs[name], seg_ids, rows)
        return Lookup(hit, out, lost)

    def _take_out(self, bad: list[tuple[int, int]], warn: bool = True) -> bool:
        """Leave damaged records out of the index, so other copies of their keys are served; True if any."""
        with self._lock:
            found = self._damage.take_out(self._segments, self._shards, bad, warn)
            if found:
                self._rebuild_index()
        return found

    def verify(self) -> Verification:
        """Check every record of every shard read against its checksum (what ``distill cache verify``
        runs): reads the whole store once. Damaged records found are taken out of this instance's index."""
        self._check_open()
        self._take_out(self._damage.verify_all(self._segments), warn=False)
        return self._damage.report(self._segments, self._shards, self._rejected)

    def _gather(self, spec: OutputSpec, seg_ids: np.ndarray, rows: np.ndarray) -> torch.Tensor | Ragged:
        return gather(self._segments, spec, seg_ids, rows)

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
