"""Errors the student side raises on purpose; each message says what to do next."""

from __future__ import annotations

import json
from dataclasses import dataclass


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


@dataclass(frozen=True)
class InputRefusal:
    """What the teachers found wrong in a batch's input, as facts rather than words (teacher-server
    sends them beside its message, `protos.kserve.REFUSAL_METADATA`), so a program can say it in
    its own terms (a gateway: which prompt of its request). `kind` "vocabulary" or "classes": id
    `value` at `index` of input `input` (row of the batch first) is outside 0..`limit` - 1, the
    model's vocabulary or the classes of the output it scores; "context": the sequences are
    `value` positions long, past the model's context of `limit` (`index` is empty)."""

    kind: str
    input: str
    value: int
    limit: int
    index: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | bytes) -> InputRefusal | None:
        """The facts as a teacher sends them (JSON), or None for malformed ones: the teacher's
        message still says what is wrong."""
        try:
            facts = json.loads(text)
            return cls(str(facts["kind"]), str(facts["input"]), int(facts["value"]), int(facts["limit"]),
                       tuple(int(i) for i in facts["index"]))
        except (ValueError, TypeError, KeyError):
            return None


class BatchRejectedError(DistillError):
    """The teachers refused this one batch: its inputs do not fit what they declared, or their model
    raised on it. Only that batch is lost: the teachers keep serving, and calling `next()` on the same
    iterator again goes on with the following batch. With `fallback="hard_labels"` the batch is
    yielded with `None` outputs instead (counted in `stats().rejected_batches`).

    `reason` is the teachers' own words, and `refusal` the facts of what they found wrong when they
    sent them (None otherwise, e.g. from Triton or for a model that raised)."""

    def __init__(self, message: str, *, reason: str = "", refusal: InputRefusal | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message
        self.refusal = refusal


class ReaderInUseError(DistillError):
    """Another thread is iterating this reader right now. One reader feeds one training loop: give
    each thread (or each rank) its own DistillReader."""


class StaleIteratorError(DistillError):
    """This iterator's pass over the loader was replaced by a newer `iter(reader)`; only the newest
    iterator of a reader yields batches."""


class NonFiniteOutputError(BatchRejectedError):
    """A teacher answered this batch with outputs that hold inf or NaN at `rows` (rows of the batch
    as the loader or `submit` gave it): a teacher whose forward pass overflowed on those inputs (as
    fp16/bf16 models do on some). One such row turns a distillation loss, and the student's weights
    with it, into NaN, so by default (`nonfinite="error"`) the batch is not delivered; like any
    `BatchRejectedError` only this batch is lost. `nonfinite="mask"` delivers it instead, with
    `teacher["VALID_ROWS"]` marking the rows to leave out of the soft loss."""

    def __init__(self, service: str, batch: int, rows: tuple[int, ...]) -> None:
        super().__init__(
            f"service {service!r} answered rows {list(rows)} of batch {batch} of this pass with outputs that hold "
            "inf or NaN: its model overflowed on those inputs. Only this batch is lost and the "
            "teachers keep serving: check those rows' inputs or the teacher's precision, catch BatchRejectedError "
            "around next() to skip such batches, or pass nonfinite='mask' (--distill_nonfinite mask) to train on "
            "them with teacher['VALID_ROWS'] leaving those rows out of the soft loss (KDLoss/TokenKDLoss valid=).")
        self.service = service
        self.batch = batch
        self.rows = rows


class RouteKeyError(BatchRejectedError):
    """Rows of this batch name no teacher (``route_by``): their key is missing, or neither a service
    nor a key of ``route_map``, and no ``default_teacher`` is set. Only this batch is lost, like any
    `BatchRejectedError`; `key` is the first such key (None: missing) and `known` the teachers."""

    def __init__(self, message: str, *, key: object, known: tuple[str, ...]) -> None:
        super().__init__(message)
        self.key = key
        self.known = known


class RoutedOutputsMismatchError(TeacherMismatchError):
    """With ``route_by`` the rows of one batch come from several teacher services and are delivered as
    one dict, so the services must answer the same outputs (names, dtypes, per-sample shapes after
    the reader's transforms); raised at start, naming the first difference."""
