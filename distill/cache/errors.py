"""Errors of the teacher-output store; each message says what to do next."""

from __future__ import annotations

import os

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
