"""The teacher-output store on the student's side: what `DistillReader(..., cache=PATH)` uses.

The engine asks three things of it, each off the event loop except the last:

* `lookup(batch)` (on the loader thread, with the batch): the batch's keys and which of them are
  stored, with the stored rows' outputs when the mode reads the store;
* `namespace` checks (once, at start): the store's namespace is the teacher's identity plus every
  output setting of the reader, so outputs of other teachers or settings are refused;
* `write_back(keys, outputs)` (on the event loop): hand the teacher's rows to a dedicated writer
  thread through a bounded queue, never blocking; when the queue is full the rows are not
  stored (they are misses again next time) and a warning says so. The writer seals on close.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from distill.cache.errors import CacheError, SchemaMismatchError, StoreNotFoundError, show_keys
from distill.cache.namespace import Namespace
from distill.cache.reader_namespace import (
    check_options,
    id_dtypes,
    key_type_of,
    per_position,
    reader_namespace,
    teacher_mismatch,
)
from distill.cache.store import TeacherOutputStore
from distill.cache.values import Ragged
from distill.checks import CACHE_MODES
from distill.options import ReaderOptions
from distill.outputs import is_ids_output
from distill.types import FieldArray, TeacherMetadata

__all__ = ["CACHE_MODES", "CacheMissError", "CachedRows", "ReaderCache", "batch_keys", "reader_namespace",
           "teacher_mismatch"]

log = logging.getLogger("distill.cache")

class CacheMissError(CacheError):
    """A sample is not in the store and no teacher may compute it (``cache_mode="read"`` without
    teachers); ``key`` is the first missing sample key."""

    def __init__(self, message: str, key: Any) -> None:
        super().__init__(message)
        self.key = key


def batch_keys(batch: Any, key: str | int) -> Any:
    """The sample keys of `batch`: its field `key` (a dict key or a tuple position), as an int64
    numpy array, or a list of bytes/str keys (content hashes)."""
    if isinstance(batch, Mapping):
        if key not in batch:
            raise TypeError(f"cache key {key!r}: the batch has no such field (keys: {list(batch)}); pass key= the "
                            "batch field holding each sample's key (a dataset index or a content hash)")
        value = batch[key]
    elif isinstance(batch, (tuple, list)) and isinstance(key, int) and -len(batch) <= key < len(batch):
        value = batch[key]
    else:
        raise TypeError(f"cache key {key!r}: a batch of type {type(batch).__name__} has no such field; pass key= a "
                        "dict key, or a position for tuple batches")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().reshape(-1)
    if isinstance(value, np.ndarray):
        return value.reshape(-1)
    return list(value)


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """A per-position output ``[n, S, ...]`` at the batch's padded width: cut to ``width`` when
    it was stored wider, padded with zeros when narrower. Stored rows hold every real position of
    their sample (a sample's tokens all fit in any batch it comes in), so only padding changes."""
    stored = t.shape[1]
    if stored == width:
        return t
    if stored > width:
        return t[:, :width].contiguous()
    out = torch.zeros((t.shape[0], width, *t.shape[2:]), dtype=t.dtype)
    out[:, :stored] = t
    return out


@dataclass
class CachedRows:
    """What the store had for one batch: its keys, the hit mask, and the hits' outputs.

    ``variable`` names the per-position outputs (``[T, ...]`` per sample): their stored rows are
    already at the batch's padded width when the inputs tell it, and are fitted to the teacher's
    width on a partial hit (:meth:`fit`).
    """

    keys: Any
    hit: np.ndarray
    outputs: dict[str, torch.Tensor]
    variable: frozenset[str] = frozenset()

    @property
    def all_hit(self) -> bool:
        return bool(self.hit.all())

    @property
    def miss_indices(self) -> np.ndarray:
        return np.flatnonzero(~self.hit)

    @property
    def hit_indices(self) -> np.ndarray:
        return np.flatnonzero(self.hit)

    def key_at(self, i: int) -> Any:
        k = self.keys[i]
        return k.item() if isinstance(k, np.generic) else k

    def missing_keys(self) -> Any:
        miss = self.miss_indices
        if isinstance(self.keys, np.ndarray):
            return self.keys[miss]
        return [self.keys[i] for i in miss]

    def fit(self, name: str, answer: torch.Tensor) -> torch.Tensor:
        """The stored rows of output ``name`` shaped like the teacher's ``answer`` for the other rows
        of the batch, to be merged with it; SchemaMismatchError when they cannot be (the teacher
        changed without its name or version changing)."""
        stored = self.outputs.get(name)
        if stored is not None and name in self.variable and stored.ndim == answer.ndim >= 2:
            stored = fit_width(stored, answer.shape[1])
        if stored is None or stored.shape[1:] != answer.shape[1:] or stored.dtype != answer.dtype:
            raise SchemaMismatchError(
                f"output {name!r} came from the teacher as {answer.dtype} {list(answer.shape[1:])} per sample; the "
                f"teacher-output store holds {None if stored is None else (stored.dtype, list(stored.shape[1:]))}: "
                "the teacher changed without its name or version changing; use another cache path")
        return stored


_STOP = object()
_SEAL = object()


WRITE_QUEUE_BATCHES = 64
"""Batches the writer thread may have queued; a training reader drops (and re-asks later) beyond it,
so the training loop never waits on the disk. `distill record` waits for the writer instead."""


class ReaderCache:
    """The store, opened for one reader, and its writer thread (see the module docstring)."""

    def __init__(self, store: TeacherOutputStore | None, mode: str, key: str | int, *, queue_batches: int = 0,
                 create: tuple[str, Namespace] | None = None, variable: frozenset[str] = frozenset(),
                 seq_inputs: tuple[str, ...] | None = None, id_dtypes: Mapping[str, torch.dtype] | None = None
                 ) -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {mode!r}")
        if (store is None) == (create is None):
            raise ValueError("pass an open store, or create=(path, namespace) for a store made at the first batch")
        self._store = store
        self._create = create  # a new store is made at the first batch, keyed like its keys (int64 or bytes)
        self.path = str(store.path) if store is not None else create[0] if create is not None else ""
        self.mode = mode
        self.key = key
        self.dropped_batches = 0
        # Per-position outputs (the teacher's [T, ...] per sample), stored ragged at the width they were
        # answered at; and the inputs whose padded width is the batch's T (None: any 2-D+ input).
        self.variable = variable
        self.seq_inputs = seq_inputs
        self.id_dtypes = dict(id_dtypes or {})  # top-k ids stored narrower than the teacher's int32
        self._variable_all: frozenset[str] | None = None
        self.hit_samples = 0  # counters for reader.stats(), written by the loader thread
        self.miss_samples = 0
        self.refresh_s = 1.0  # list the store's shards at most this often while reading
        self._refreshed = time.monotonic()
        self._stale = threading.Event()  # our writer sealed a shard: read it at the next lookup
        self._seals_asked = 0
        self._seals_done = 0
        self._sealed = threading.Condition()
        self.written_samples = 0
        self.write_error: BaseException | None = None
        # The fingerprints of the teachers answering now, {service: fingerprint}, read at each write_back
        # and recorded in the shards (the reader's engine sets it; None: not recorded).
        self.fingerprints: Callable[[], Mapping[str, str]] | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_batches or WRITE_QUEUE_BATCHES)
        self._thread: threading.Thread | None = None
        if store is not None and mode != "read":
            self._start_writer()

    @property
    def store(self) -> TeacherOutputStore:
        """The open store (a new one exists once the first batch was looked up)."""
        if self._store is None:
            raise CacheError(f"the teacher-output store at {self.path} is made at the first batch; none came yet")
        return self._store

    def _start_writer(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="distill-cache-writer", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: str, options: ReaderOptions, meta: TeacherMetadata | None) -> ReaderCache:
        """Open the store at `path` for a reader (blocking: call it off the event loop). With a
        teacher's metadata the namespace is built from it and checked; without one (offline, `read`
        mode) the store must exist and its namespace must agree with the reader's options."""
        mode: str = options.cache_mode
        key = options.key
        assert key is not None  # ReaderOptions requires key= with cache=
        if meta is not None:
            ns = reader_namespace(options, meta)
            variable, seq_inputs = per_position(ns, meta)
            ids = id_dtypes(ns, meta)
            key_type = key_type_of(path)
            if key_type is None and mode != "read":
                return cls(None, mode, key, create=(path, ns), variable=variable, seq_inputs=seq_inputs,
                           id_dtypes=ids)
            store = TeacherOutputStore.open(path, ns, mode="r" if mode == "read" else "a",
                                            key_type=key_type or "int64")
            return cls(store, mode, key, variable=variable, seq_inputs=seq_inputs, id_dtypes=ids)
        else:
            try:
                store = TeacherOutputStore.open(path, mode="r")
            except StoreNotFoundError as e:
                raise StoreNotFoundError(
                    f"{e}. Without a teacher the reader cannot name the namespace of a new store: record it with "
                    "`distill record` first, or give the reader teachers") from e
            check_options(options, store.namespace, path)
            if mode != "read":
                store.close()
                store = TeacherOutputStore.open(path, store.namespace, mode="a")
        return cls(store, mode, key)

    # ---- reading (loader thread) -------------------------------------------------------------
    def lookup(self, batch: Any, width: int | None = None) -> CachedRows:
        """The batch's keys and what the store holds of them (nothing is read in `write` mode).
        Per-position outputs come at the padded ``width`` (default: the longest stored row)."""
        keys = batch_keys(batch, self.key)
        if self._create is not None:  # a new store: keyed by int64 for integer keys, else by bytes
            path, ns = self._create
            key_type: Literal["int64", "bytes"] = (
                "int64" if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu" else "bytes")
            self._store = TeacherOutputStore.open(path, ns, mode="a", key_type=key_type)
            self._create = None
            self._start_writer()
        if self.mode == "write":
            n = len(keys)
            return CachedRows(keys, np.zeros(n, dtype=bool), {}, self.variable)
        now = time.monotonic()
        if self._stale.is_set() or now - self._refreshed >= self.refresh_s:  # shards sealed meanwhile
            self._stale.clear()
            self.store.refresh()
            self._refreshed = now
        # A damaged stored record is never served: in `read` mode it is an error naming the shard and
        # keys; otherwise its samples are misses, recomputed by the teachers and stored again.
        found = self.store.lookup(keys, damaged="raise" if self.mode == "read" else "miss")
        for shard, lost in found.damaged.items():
            log.warning("%d samples of this batch (keys %s) have a damaged stored record in shard %s: the teachers "
                        "recompute them and they are stored again", len(lost), show_keys(lost), shard)
        outputs: dict[str, torch.Tensor] = {}
        variable = self._variable_stored()
        if found.n_hits:
            for name, value in found.outputs.items():
                if isinstance(value, Ragged):
                    padded = value.padded()
                    t = padded if width is None else fit_width(padded, width)
                else:
                    t = value
                if is_ids_output(name) and t.dtype in (torch.int16, torch.uint16):
                    t = t.to(torch.int32)  # stored narrow (id_dtype): the teacher's dtype again
                outputs[name] = t
        return CachedRows(keys, found.hit, outputs, frozenset(variable))

    def _variable_stored(self) -> frozenset[str]:
        """Per-position outputs: the teacher's, and those the store holds ragged (known once a shard is read)."""
        if self._variable_all is None:
            specs = self.store.output_specs
            stored = frozenset(n for n, spec in specs.items() if spec.variable)
            if not specs:
                return self.variable | stored
            self._variable_all = self.variable | stored
        return self._variable_all

    def _width(self, fields: Mapping[str, FieldArray]) -> int | None:
        """The batch's padded length: the second dimension its sequence inputs share (None: no such
        inputs, or they disagree)."""
        names = self.seq_inputs if self.seq_inputs is not None else tuple(fields)
        widths = {fields[n].array.shape[1] for n in names if n in fields and fields[n].array.ndim >= 2}
        return widths.pop() if len(widths) == 1 else None

    def rows_to_send(self, batch: Any, size: int, fields: dict[str, FieldArray]
                     ) -> tuple[dict[str, FieldArray], CachedRows]:
        """What of a batch still goes to a teacher: the inputs of the samples the store lacks (all
        of them on a miss, none on a full hit), and the store's rows for the rest."""
        cached = self.lookup(batch, self._width(fields) if self.variable or self.seq_inputs is None else None)
        if len(cached.hit) != size:
            raise ValueError(f"cache key {self.key!r} holds {len(cached.hit)} keys for a batch of {size} "
                             "samples: key= must name a field with one key per sample")
        hits = int(cached.hit.sum())
        self.hit_samples += hits
        self.miss_samples += size - hits
        if hits == size:
            fields = {}  # nothing goes to a teacher
        elif hits:
            miss = cached.miss_indices
            fields = {n: FieldArray(np.ascontiguousarray(f.array[miss]), f.datatype) for n, f in fields.items()}
        return fields, cached

    def miss_error(self, rows: CachedRows, seq: int) -> CacheMissError:
        miss = rows.miss_indices
        key = rows.key_at(int(miss[0]))
        damaged = self.store.damaged_shards
        return CacheMissError(
            f"sample key {key!r} (row {int(miss[0])} of batch {seq}, {len(miss)} of its {len(rows.hit)} samples "
            f"missing) is not in the teacher-output store at {self.path}, and cache_mode='read' has no "
            "teacher to ask: record the data set first (`distill record`), give the reader teachers, or pass "
            "fallback='hard_labels' to train such batches on labels alone" + (
                f". {len(damaged)} of the store's shards are damaged and not read ({show_keys(damaged, 3)}), and "
                f"the sample may be in one: `distill cache verify {self.path}` lists the damage" if damaged else ""),
            key)

    def counters(self) -> dict[str, int]:
        """What `reader.stats()` shows of the store: samples served from it, samples it lacked, and
        teacher samples written to it."""
        return {"cache_hits": self.hit_samples, "cache_misses": self.miss_samples,
                "cache_written": self.written_samples}

    # ---- writing (event loop -> writer thread) ---------------------------------------------
    def write_back(self, keys: Any, outputs: Mapping[str, torch.Tensor]) -> None:
        """Queue the teacher's rows for the store; never blocks (a full queue drops them, with a warning).
        Per-position outputs go as ragged rows at the width the teacher answered them at, so batches
        of other lengths share one store."""
        if self._thread is None or len(keys) == 0:
            return
        rows: dict[str, Any] = {}
        for name, t in outputs.items():
            if name in self.variable and t.ndim >= 2:
                n, width = t.shape[0], t.shape[1]
                rows[name] = Ragged(t.reshape(n * width, *t.shape[2:]), torch.full((n,), width, dtype=torch.int64))
            else:
                rows[name] = t
        try:
            self._queue.put_nowait((keys, rows, {} if self.fingerprints is None else dict(self.fingerprints())))
        except queue.Full:
            self.dropped_batches += 1
            if self.dropped_batches == 1 or self.dropped_batches % 100 == 0:
                log.warning("the teacher-output store's writer is behind; %d batches were not stored (they will "
                            "be asked of a teacher again)", self.dropped_batches)

    def seal(self) -> None:
        """Seal what was written so far once the queue before it is written (the end of a pass), so
        the next pass reads it from the store; never blocks."""
        if self._thread is None:
            return
        try:
            self._seals_asked += 1
            self._queue.put_nowait(_SEAL)
        except queue.Full:
            self._seals_asked -= 1
            pass  # the writer is behind: the shard is sealed later (at its size limit, or on close)

    def wait_sealed(self, timeout: float) -> bool:
        """Block until every seal asked for so far is done (for tests and tools); False on timeout."""
        asked = self._seals_asked
        with self._sealed:
            return self._sealed.wait_for(lambda: self._seals_done >= asked or self._thread is None, timeout)

    def _narrowed(self, outputs: Mapping[str, Any], narrow: Mapping[str, torch.dtype]) -> dict[str, Any]:
        """Top-k ids in the smallest dtype their vocabulary fits (on the writer thread, off the loop)."""
        out = dict(outputs)
        for name, dtype in narrow.items():
            value = out.get(name)
            if isinstance(value, Ragged):
                out[name] = Ragged(value.values.to(dtype), value.lengths)
            elif isinstance(value, torch.Tensor):
                out[name] = value.to(dtype)
        return out

    def _write_loop(self) -> None:
        # Narrow ids only where the store holds none yet, or holds them narrow already: a store
        # recorded with int32 ids keeps them (appends must match its schema).
        stored = self.store.output_specs
        narrow = {n: d for n, d in self.id_dtypes.items() if n not in stored or stored[n].torch_dtype == d}
        try:
            with self.store.writer() as writer:
                while True:
                    item = self._queue.get()
                    if item is _STOP:
                        return
                    if item is _SEAL:
                        if writer.seal() is not None:
                            self._stale.set()
                        with self._sealed:
                            self._seals_done += 1
                            self._sealed.notify_all()
                        continue
                    keys, outputs, fingerprints = item
                    try:
                        writer.set_fingerprints(fingerprints)
                        writer.append(keys, self._narrowed(outputs, narrow) if narrow else outputs)
                        self.written_samples += len(keys)
                    except CacheError as e:  # e.g. outputs whose shape changed: stop storing, keep training
                        self.write_error = e
                        log.error("writing to the teacher-output store at %s failed; no more outputs are stored: "
                                  "%s", self.path, e)
                        self._drain()
                        return
        except Exception as e:  # pragma: no cover - disk full, permissions
            self.write_error = e
            log.exception("the teacher-output store's writer at %s failed", self.path)
            self._drain()

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item is _SEAL:
                with self._sealed:
                    self._seals_done += 1
                    self._sealed.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, seal the shard, join the writer thread and close the store (blocking)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the teacher-output store's writer did not finish in %g s", timeout)
            self._thread = None
        if self._store is not None:
            self._store.close()
