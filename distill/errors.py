"""Errors the student side raises on purpose; each message says what to do next."""

from __future__ import annotations


class DistillError(Exception):
    """Base class of the reader's errors."""


class NoTeacherError(DistillError):
    """No usable teacher for `no_teacher_timeout` seconds.

    Raised from the training loop's `for batch, teacher in reader` so a job never hangs silently;
    pass `fallback="hard_labels"` to keep training on labels alone instead.
    """


class TeacherMismatchError(DistillError):
    """The teachers do not serve what the reader was asked to send or fetch (names, dtypes, shapes)."""


class ReaderClosedError(DistillError):
    """The reader was closed while the training loop still iterated it."""
