"""Errors of the teacher-output store; each message says what to do next."""

from __future__ import annotations

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
