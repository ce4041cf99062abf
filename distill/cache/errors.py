"""Errors of the teacher-output store; each message says what to do next."""

from __future__ import annotations

import os
from typing import Any

from distill.errors import DistillError


class CacheError(DistillError):
    """Base class of the store's errors."""


class StoreNotFoundError(CacheError):
    """A store opened for reading does not exist (no ``store.json`` at the path)."""


class NamespaceMismatchError(CacheError):
    """The store holds outputs of another teacher or other output settings than the ones asked for.

    ``fields`` names the namespace fields that differ, so a caller can tell a new model version
    from a changed temperature without parsing the message.
    """

    def __init__(self, message: str, fields: tuple[str, ...]) -> None:
        super().__init__(message)
        self.fields = fields


class SchemaMismatchError(CacheError):
    """Appended outputs do not match what the store already holds (names, dtypes, per-sample shapes)."""


class DamagedRecordError(CacheError):
    """Stored records whose checksum does not match what was written (a bad disk, a partial copy, bit rot).

    Raised instead of serving them: a damaged record is never an answer. ``damaged`` maps each
    shard file to the asked sample keys whose only stored copy is damaged there; ``shard`` and
    ``keys`` are the first shard and all those keys.
    """

    def __init__(self, message: str, damaged: dict[str, list[Any]]) -> None:
        super().__init__(message)
        self.damaged = damaged

    @property
    def shard(self) -> str:
        return next(iter(self.damaged), "")

    @property
    def keys(self) -> list[Any]:
        return [k for keys in self.damaged.values() for k in keys]


class DamagedShardError(CacheError):
    """A shard whose file structure (footer, schema, a record batch's header) is damaged or fails its
    checksum: none of it can be trusted, so the store does not read it (``info()`` lists it as rejected)."""


class StoreClosedError(CacheError):
    """The store or writer was used after ``close()``."""


def require_store(path: str) -> None:
    """Raise :class:`StoreNotFoundError` unless ``path`` holds a store (its ``store.json``).

    A reader in ``cache_mode="read"`` never writes, so without a store every sample would go to a
    teacher and nothing would be kept: that is a wrong path or a forgotten recording, and it is
    said at start rather than found out as a slow epoch. Blocking (a stat): call it off the event loop.
    """
    if not os.path.isfile(os.path.join(path, "store.json")):
        raise StoreNotFoundError(
            f"no teacher-output store at {path} (no store.json), and cache_mode='read' only reads one: record it "
            "first (`distill record --cache PATH ...`), or, with teachers, use cache_mode='read_write' to fill it "
            "while training; or fix the path")


def show_keys(keys: list[Any], limit: int = 8) -> str:
    """Keys for a message: the first ``limit`` of them, and how many more."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def damaged_message(store: str, damaged: dict[str, list[Any]]) -> str:
    """What :class:`DamagedRecordError` says: where, which keys, and the three ways on."""
    where = "; ".join(f"keys {show_keys(keys)} in shard {shard}" for shard, keys in damaged.items())
    return (
        f"the teacher-output store at {store} holds damaged records ({where}): their bytes do not match the "
        "checksum written with them (a bad disk, a partial copy or bit rot), so they are not used. Run "
        f"`distill cache verify {store}` to list every damaged record; then delete the damaged shard and record "
        "again, or read with cache_mode='read_write' so the teachers recompute the damaged records and store "
        "them again")
