"""Errors the student side raises on purpose; each message says what to do next."""

from __future__ import annotations


class DistillError(Exception):
    """Base class of the reader's errors."""


class NoTeacherError(DistillError):
    """No usable teacher for `no_teacher_timeout` seconds.

    Raised from the training loop's `for batch, teacher in reader` so a job never hangs silently;
    pass `fallback="hard_labels"` to keep training on labels alone instead.
    """


class TeacherAccessError(NoTeacherError):
    """The teachers refused this student access: a server that restricts part of its API (a hardened
    Triton; PyTriton restricts its model-repository API by default) or wants credentials.

    Raised at once, not after `no_teacher_timeout`: waiting does not change a server's access rules.
    The message names each refusing teacher, the call it refused and the server's own words, and the
    fix: `model=` (`--distill_model`) so the reader need not list the server's models, and
    `headers=` (`--distill_header KEY=VALUE`) with the header the server expects.
    """


class TeacherMismatchError(DistillError):
    """The teachers do not serve what the reader was asked to send or fetch (names, dtypes, shapes)."""


class ReaderClosedError(DistillError):
    """The reader was closed while the training loop still iterated it."""


class BatchRejectedError(DistillError):
    """The teachers refused this one batch: its inputs do not fit what they declared, or their model
    raised on it. Only that batch is lost: the teachers keep serving, and calling `next()` on the same
    iterator again goes on with the following batch. With `fallback="hard_labels"` the batch is
    yielded with `None` outputs instead (counted in `stats().rejected_batches`)."""


class ReaderInUseError(DistillError):
    """Another thread is iterating this reader right now. One reader feeds one training loop: give
    each thread (or each rank) its own DistillReader."""


class StaleIteratorError(DistillError):
    """This iterator's pass over the loader was replaced by a newer `iter(reader)`; only the newest
    iterator of a reader yields batches."""
