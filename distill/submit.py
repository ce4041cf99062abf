"""Batches the training loop makes itself, scored one step at a time: on-policy distillation.

A reader built without a loader, ``DistillReader(None, teachers=..., inputs=..., ...)``, takes
batches from `DistillReader.submit` instead of reading them ahead (iterating it raises TypeError,
and a reader with a loader refuses ``submit``). The batch goes through the same engine as a
loader's: routing, failover to another teacher, hedging, exactly-once delivery, the demand
reported to the autoscaler. The API, stable for the training loop and for asyncio programs on
their own event loop (a gateway):

    fut = reader.submit(batch)            # a concurrent.futures.Future; never blocks
    outputs = fut.result()                # {"LOGITS_TOKEN_LOGPROBS": tensor, ...}, like a loader's
    outputs = reader.score(batch)         # submit(batch).result(): blocking
    outputs = await asyncio.wrap_future(reader.submit(batch))   # from any event loop
    fut = reader.submit(batch, temperature=0.7)                 # this batch at its own temperature

Staleness is the caller's choice, never hidden: 0 is ``score(batch)`` each step (generate, score,
train); 1 is submit step n, generate step n+1 while the teachers score step n, then take step n's
result and train on it (the samples of step n+1 came from weights one update older than those they
train). Generation and the optimizer run on the caller's thread only; the engine's thread never
touches the model.

A batch's ``temperature=`` replaces the reader's ``temperature`` option for that batch alone: the
teachers apply it per request, so one reader (one student in the registry, one demand figure)
serves any number of temperatures at once, e.g. a gateway whose clients each score at their own.
Batches share a request only with batches of the same temperature.

Bounds and failure, each said by an exception:
* at most ``prefetch`` submitted batches are unsettled at once; a ``submit`` beyond that raises
  `SubmitLimitError` at once (never blocks: a gateway's event loop calls it), so wait for a result
  first, or raise ``prefetch``;
* every future settles within its deadline (``deadline_s``, default ``no_teacher_timeout + 2 *
  timeout``, retries included): with the outputs, `BatchRejectedError` (the teachers refused this
  batch), `NoTeacherError` (no teacher for ``no_teacher_timeout``) or `TimeoutError`;
* ``close()`` fails every unsettled future with `ReaderClosedError`.
* a future cancelled by its caller (``fut.cancel()``, or a cancelled ``wrap_future``) is dropped;
  the teachers may still answer it.

A teacher that must score given tokens takes them as the input ``SCORE_IDS`` (INT32 ``[B, T, m]``,
padded like the ids), e.g. ``inputs={"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask",
"SCORE_IDS": "score_ids"}``: teachers read it without declaring it in their metadata, so the reader
sends it to any teacher whose declared inputs take the rest of the batch, and a teacher that cannot
score (no padded token input) refuses the batch (`BatchRejectedError`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from distill.checks import checked, positive_float
from distill.errors import ReaderClosedError
from distill.types import ParameterValue

__all__ = ["ScoreFuture", "Submissions", "SubmitLimitError", "Temperatures"]


class SubmitLimitError(RuntimeError):
    """``submit`` was called with ``prefetch`` batches unsettled: take a result first."""


class Temperatures:
    """The request parameters of batches submitted at their own temperature: the reader's, with
    that temperature. One mapping per temperature is kept and reused, since the request encoder
    reuses a serialized header by its parameter mapping; clients choose the values, so at most
    `LIMIT` are kept (the table starts afresh beyond that)."""

    LIMIT = 64

    def __init__(self, base: Mapping[str, ParameterValue]) -> None:
        self._base = base
        self._lock = threading.Lock()
        self._made: dict[float, Mapping[str, ParameterValue]] = {}

    def __call__(self, temperature: float | None) -> Mapping[str, ParameterValue] | None:
        """The parameters of a batch at `temperature`; None (the reader's own) for None or the
        temperature the reader states. ValueError for a temperature that is not a number > 0."""
        if temperature is None:
            return None
        value = checked(positive_float, "temperature", temperature)
        if self._base.get("temperature") == value:  # stated by the reader; unstated, 1.0 is stated here
            return None
        with self._lock:
            found = self._made.get(value)
            if found is None:
                if len(self._made) >= self.LIMIT:
                    self._made.clear()
                found = self._made[value] = MappingProxyType({**self._base, "temperature": value})
        return found


class ScoreFuture(concurrent.futures.Future[Any]):
    """A submitted batch's teacher outputs. ``result()`` puts them on the reader's device (on the
    calling thread) and counts the time it waited in the demand the reader reports."""

    def __init__(self, size: int, on_result: Callable[[int, float], None], to_device: Callable[[Any], Any]) -> None:
        super().__init__()
        self._size = size
        self._on_result = on_result
        self._to_device = to_device
        self._taken = False
        self._moved: Any = None

    def result(self, timeout: float | None = None) -> Any:
        started = time.perf_counter()
        outputs = super().result(timeout)
        if not self._taken:  # once, on the first thread that takes it
            self._taken = True
            self._on_result(self._size, time.perf_counter() - started)
            self._moved = self._to_device(outputs)
        return self._moved


class Submissions:
    """The unsettled submitted batches of one reader: the bound on them, and the engine's sink in
    submit mode (an error that ends the engine's pass fails every one of them)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    def add(self, fut: concurrent.futures.Future[Any]) -> None:
        """Count `fut` among the unsettled, or raise (any thread)."""
        with self._lock:
            if self._closed:
                raise ReaderClosedError("this reader is closed; make a new one")
            if len(self._pending) >= self.limit:
                raise SubmitLimitError(
                    f"{len(self._pending)} submitted batches are not settled yet (the limit is prefetch="
                    f"{self.limit}): take a result (fut.result()) before submitting more, or raise prefetch")
            self._pending.add(fut)
        fut.add_done_callback(self._settled)

    def _settled(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for fut in pending:
            try:
                fut.set_exception(error)
            except concurrent.futures.InvalidStateError:  # settled or cancelled meanwhile
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.fail_all(ReaderClosedError("the reader was closed before the teachers answered this batch"))

    # ---- the engine's sink (distill.batches.Sink); submitted batches settle their own future ----
    def batch(self, epoch: int, batch: Any, outputs: Any, size: int) -> None:  # pragma: no cover - not used
        raise AssertionError("submitted batches settle their futures")

    def end(self, epoch: int) -> None:  # pragma: no cover - a submit pass never ends
        pass

    def error(self, epoch: int, error: BaseException) -> None:
        self.fail_all(error)

    def rejected(self, epoch: int, error: BaseException) -> None:  # pragma: no cover - not used
        raise AssertionError("submitted batches settle their futures")
