"""What a store hands back: looked-up outputs (:class:`Lookup`, :class:`Ragged`) and its description.

Plain value types with no file access, so that callers (a student's reader, ``distill cache
info``) can hold and pass them around without touching the store that produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from distill.cache.format import OutputSpec
from distill.cache.namespace import Namespace

__all__ = ["DamagedRecord", "Lookup", "Ragged", "StoreInfo", "UnsealedFile", "Verification"]


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
    # With lookup(..., damaged="miss"): shard file -> the asked keys missed because their only stored
    # record there is damaged (see distill.cache.integrity).
    damaged: dict[str, list[Any]] = field(default_factory=dict)

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
class DamagedRecord:
    """A stored record (the rows of one ``append``) whose bytes do not match its checksum: never served."""

    shard: str  # the shard file
    batch: int  # its record batch in the shard
    rows: tuple[int, int]  # [start, stop) in that record batch
    keys: tuple[Any, ...]  # as stored (the keys may be damaged too)


@dataclass
class Verification:
    """What ``distill cache verify`` found: every record of every shard checked against its checksum."""

    path: str
    shards: int  # shards read (damaged records or not)
    records: int  # records checked
    rows: int
    damaged: list[DamagedRecord] = field(default_factory=list)
    damaged_shards: list[tuple[str, str]] = field(default_factory=list)  # (file, why): none of it is read
    unverifiable: list[str] = field(default_factory=list)  # shards written before checksums
    rejected: list[tuple[str, str]] = field(default_factory=list)  # other namespaces or shapes: not this store's

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.damaged_shards

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "ok": self.ok, "shards": self.shards, "records": self.records, "rows": self.rows,
            "damaged": [{"shard": d.shard, "batch": d.batch, "rows": list(d.rows),
                         "keys": [k.hex() if isinstance(k, bytes) else k for k in d.keys]} for d in self.damaged],
            "damaged_shards": [{"shard": n, "reason": r} for n, r in self.damaged_shards],
            "unverifiable": self.unverifiable,
            "rejected": [{"shard": n, "reason": r} for n, r in self.rejected],
        }

    def render(self, max_keys: int = 8) -> str:
        lines = []
        for d in self.damaged:
            keys = ", ".join(repr(k) for k in d.keys[:max_keys]) + (
                f" and {len(d.keys) - max_keys} more" if len(d.keys) > max_keys else "")
            lines.append(f"damaged     {d.shard}  record batch {d.batch} rows {d.rows[0]}..{d.rows[1] - 1}  "
                         f"keys {keys or '(unreadable)'}")
        lines += [f"damaged     {name}  ({why}; none of it is read)" for name, why in self.damaged_shards]
        lines += [f"unverified  {name}  (written before checksums)" for name in self.unverifiable]
        lines += [f"rejected    {name}  ({why})" for name, why in self.rejected]
        bad_rows = sum(d.rows[1] - d.rows[0] for d in self.damaged)
        lines.append(
            f"{self.path}: {self.shards} shards read, {self.records:,} records ({self.rows:,} rows) checked: "
            f"{len(self.damaged)} damaged records ({bad_rows:,} rows), {len(self.damaged_shards)} damaged shards, "
            f"{len(self.unverifiable)} unverifiable shards")
        if not self.ok:
            lines.append(
                "what to do: damaged records are never served; reading with cache_mode='read' raises "
                "DamagedRecordError, and cache_mode='read_write' has the teachers recompute them and stores them "
                "again (in a new shard; the damaged one is still reported here). To be rid of the damage, delete "
                "the damaged shards listed and record again (their intact samples are recomputed too)")
        return "\n".join(lines)


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
