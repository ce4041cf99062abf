"""What a store found damaged, and what its lookups must therefore not serve.

A :class:`TeacherOutputStore` owns one :class:`Damage`: the records that failed their checksum
(:mod:`distill.cache.integrity`), taken out of the store's index so that another stored copy of
their keys is served, or none; the keys they held, so that a lookup of such a key is an error (or
a miss to recompute) rather than an ordinary miss; and the shards whose file structure is damaged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distill.cache.errors import show_keys
from distill.cache.format import KeyType, _as_bytes_list, _as_int_keys
from distill.cache.values import DamagedRecord, Verification

if TYPE_CHECKING:
    from distill.cache.shards import _Segment, _Shard

__all__ = ["Damage"]

log = logging.getLogger("distill.cache")
_WARNED_UNVERIFIED: set[str] = set()  # stores whose unverifiable shards were warned about (once a process)


class Damage:
    """The damaged records and shards of one store instance, as found so far."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.records: list[DamagedRecord] = []  # taken out of the index
        self.keys: dict[Any, str] = {}  # their keys (as stored) -> shard file
        self.shards: dict[str, str] = {}  # shard name -> why its file structure is damaged; never read
        self.unverified = False  # some record read is not verified yet: lookups check what they touch

    def _file(self, name: str) -> str:
        return str(self.root / "shards" / name)

    def shard(self, name: str, error: Exception) -> None:
        """Shard ``name`` cannot be read: its footer, schema or a record batch header is damaged."""
        self.shards[name] = str(error).splitlines()[0][:200]
        log.warning("shard %s of the teacher-output store is damaged (%s) and not read: its samples are misses. "
                    "`distill cache verify %s` lists all damage; delete the shard and record again",
                    self._file(name), self.shards[name], self.root)

    def loaded(self, segments: Sequence[_Segment], shards: Sequence[_Shard]) -> None:
        """Shards were added: records to verify, and (once a process) a warning about shards without checksums."""
        self.unverified = any(s.checks is not None and not s.checks.done for s in segments)
        unchecked = [s.name for s in shards if not s.checksums]
        if unchecked and str(self.root) not in _WARNED_UNVERIFIED:
            _WARNED_UNVERIFIED.add(str(self.root))
            log.warning("the teacher-output store at %s holds %d shards written before record checksums (%s): they "
                        "are read unverified; record them again to have every read checked", self.root,
                        len(unchecked), show_keys(unchecked, 3))

    def verify(self, segments: Sequence[_Segment], seg_ids: np.ndarray, rows: np.ndarray) -> list[tuple[int, int]]:
        """Verify the records holding these (segment, row) pairs that are not verified yet: the damaged
        ones, as (segment, record)."""
        bad = []
        for i in np.unique(seg_ids).tolist():
            checks = segments[i].checks
            if checks is not None and not checks.done:
                bad += [(i, r) for r in checks.verify(checks.records_of(rows[seg_ids == i]))]
        return bad

    def verify_all(self, segments: Sequence[_Segment]) -> list[tuple[int, int]]:
        """Verify every record not verified yet; the damaged ones."""
        bad = []
        for i, seg in enumerate(segments):
            if seg.checks is not None and not seg.checks.done:
                bad += [(i, r) for r in seg.checks.verify(np.arange(len(seg.checks.ends)))]
        return bad

    def take_out(self, segments: Sequence[_Segment], shards: Sequence[_Shard], bad: list[tuple[int, int]],
                 warn: bool = True) -> bool:
        """Mark the rows of damaged records dead (the caller rebuilds the index); True if there were any."""
        self.unverified = any(s.checks is not None and not s.checks.done for s in segments)
        for i, record in bad:
            seg = segments[i]
            assert seg.checks is not None
            start, stop = seg.checks.rows(record)
            if seg.alive is None:
                seg.alive = np.ones(len(seg.keys), dtype=bool)
            seg.alive[start:stop] = False
            shard = self._file(shards[seg.shard].name)
            found = DamagedRecord(shard, seg.checks.index, (start, stop), tuple(seg.checks.keys(record)))
            self.records.append(found)
            self.keys.update(dict.fromkeys(found.keys, shard))
            if warn:
                log.warning("the teacher-output store at %s: the record of keys %s in shard %s does not match its "
                            "checksum and is not used; `distill cache verify %s` lists all damage", self.root,
                            show_keys(list(found.keys)), shard, self.root)
        return bool(bad)

    def asked(self, key_type: KeyType, keys: Any, hit: np.ndarray) -> dict[str, list[Any]]:
        """The missed ``keys`` whose stored record is damaged, by shard file (in asked order)."""
        if not self.keys or bool(hit.all()):
            return {}
        miss = np.flatnonzero(~hit)
        if key_type == "int64":
            asked: list[Any] = _as_int_keys(keys)[miss].tolist()
        else:
            raw = _as_bytes_list(keys)
            asked = [raw[i] for i in miss]
        out: dict[str, list[Any]] = {}
        for k in asked:
            shard = self.keys.get(k)
            if shard is not None:
                out.setdefault(shard, []).append(k)
        return out

    def report(self, segments: Sequence[_Segment], shards: Sequence[_Shard], rejected: dict[str, str]
               ) -> Verification:
        """What ``distill cache verify`` prints (after :meth:`verify_all`)."""
        checked = [s.checks for s in segments if s.checks is not None]
        return Verification(
            path=str(self.root), shards=len(shards), records=sum(len(c.ends) for c in checked),
            rows=sum(int(c.ends[-1]) for c in checked if len(c.ends)), damaged=list(self.records),
            damaged_shards=sorted((self._file(n), why) for n, why in self.shards.items()),
            unverifiable=[self._file(s.name) for s in shards if not s.checksums],
            rejected=sorted((self._file(n), why) for n, why in rejected.items() if n not in self.shards))
