"""DistillReader: the training loop's view of the mesh.

    with DistillReader(loader, teachers="127.0.0.1:9898", inputs=["INPUT"], outputs=["LOGITS"]) as reader:
        for batch, teacher in reader:          # teacher: {"LOGITS": tensor}
            ...

It is a plain iterator: the asyncio engine runs on its own thread (uvloop when available), reads
ahead up to `prefetch` batches, and has their teacher outputs ready by the time the loop asks.
Each `iter(reader)` is one pass over `loader` (an epoch). Every batch the loader yields comes out
exactly once, with its teacher outputs, in loader order unless `ordered=False`.

A batch the teachers refuse (inputs that do not fit their metadata, or a model that raises on it)
raises `BatchRejectedError` from `next()` in its place; the iterator stays usable and the next
`next()` yields the following batch. One reader feeds one training loop: a second `iter()` while
another thread is inside `next()` raises `ReaderInUseError`, and an iterator replaced by a newer
`iter()` raises `StaleIteratorError` instead of waiting for batches that will never come.

On-policy: a reader built with no loader, ``DistillReader(None, ...)``, scores the batches the
training loop makes itself, one step at a time: ``reader.submit(batch)`` returns a
``concurrent.futures.Future`` of the outputs, ``reader.score(batch)`` waits for them (the API, its
bounds and its errors: ``distill.submit``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from distill.batches import Submitted, extract_inputs
from distill.checks import CACHE_MODES
from distill.engine import Engine
from distill.errors import BatchRejectedError, ReaderClosedError, ReaderInUseError, StaleIteratorError
from distill.options import ReaderOptions, default_student_id
from distill.readahead import PREFETCH
from distill.stats import ConsumptionMeter, ReaderStats
from distill.submit import ScoreFuture, Submissions, Temperatures

# ReaderOptions and its helpers live in distill.options (below the engine, which reads them); they
# are re-exported here, where the reader's users have always found them.
__all__ = ["CACHE_MODES", "DistillReader", "ReaderOptions", "default_student_id"]

log = logging.getLogger("distill.reader")

# The queue between the engine thread and the training loop carries (epoch, kind, payload).
# BATCHES is a list of finished batches; ERROR ends the pass; REJECTED is one batch's error, in
# that batch's place.
BATCHES, END, ERROR, REJECTED = "batches", "end", "error", "rejected"
BATCH = "batch"  # what the training loop's iterator hands on for each batch of a BATCHES item


class Outbox:
    """The engine's sink (`distill.engine.Sink`) on the reader's side: a thread-safe queue that the
    training loop's thread reads with `items`.

    Batches finished in one turn of the event loop go over as one item, put when the turn is over:
    the training loop, waiting for them, is woken once for them all, not once for each while the
    engine still holds the GIL for the turn's other answers."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, str, Any]] = queue.SimpleQueue()  # put/get in C
        self._pending: list[tuple[Any, Any, int]] = []
        self._pending_epoch = 0

    def batch(self, epoch: int, batch: Any, outputs: Any, size: int) -> None:
        if self._pending and epoch != self._pending_epoch:
            self._flush()
        if not self._pending:
            self._pending_epoch = epoch
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((batch, outputs, size))

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._queue.put((self._pending_epoch, BATCHES, pending))

    def end(self, epoch: int) -> None:
        self._flush()
        self._queue.put((epoch, END, None))

    def error(self, epoch: int, error: BaseException) -> None:
        self._flush()
        self._queue.put((epoch, ERROR, error))

    def rejected(self, epoch: int, error: BaseException) -> None:
        self._flush()
        self._queue.put((epoch, REJECTED, error))

    def items(self, epoch: int, alive: Callable[[], bool], poll_s: float = 0.5) -> Iterator[tuple[str, Any]]:
        """Items of `epoch`, a BATCH for each batch; stale epochs are skipped. Raises if the engine died."""
        while True:
            try:
                item_epoch, kind, payload = self._queue.get(timeout=poll_s)
            except queue.Empty:
                if not alive():
                    raise RuntimeError("the reader's engine thread stopped unexpectedly") from None
                continue
            if item_epoch != epoch:
                continue
            if kind == BATCHES:
                for one in payload:
                    yield BATCH, one
            else:
                yield kind, payload


def as_device(outputs: Any, device: torch.device | None) -> Any:
    """Teacher outputs on the student's device (non-blocking from pinned memory on CUDA)."""
    if device is None or outputs is None:
        return outputs
    if isinstance(outputs, torch.Tensor):
        return outputs.to(device, non_blocking=True)
    return {k: as_device(v, device) for k, v in outputs.items()}


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class DistillReader:
    """Wraps a loader; yields (batch, teacher_outputs). See the module docstring.

    `DistillReader(loader, inputs=["INPUT"], teachers="host:port")`: the keywords are the fields of
    `ReaderOptions` (documented there), or pass a built `ReaderOptions` as `options=`.
    """

    def __init__(self, loader: Iterable[Any] | None, options: ReaderOptions | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise TypeError("pass either options=ReaderOptions(...) or keyword arguments, not both")
        self._options = options if options is not None else ReaderOptions(**kwargs)
        self._loader = loader
        # No loader: batches come from submit() (distill.submit), at most `prefetch` unsettled.
        self._submissions = Submissions(self._options.prefetch or PREFETCH) if loader is None else None
        self._temperatures = Temperatures(self._options.request_parameters)
        if self._submissions is not None and self._options.cache is not None:
            raise ValueError("a reader without a loader scores new batches each step, which a teacher-output "
                             "store would never hold: drop cache=, or give the reader a loader")
        self._meter = ConsumptionMeter()
        self._out = Outbox()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._closed = False
        self._epoch = 0  # the newest pass; only its iterator yields
        self._in_next = threading.Lock()  # held while a thread is inside next() or starting a pass

    @classmethod
    def from_args(cls, args: argparse.Namespace, loader: Iterable[Any], **kwargs: Any) -> DistillReader:
        """Build from `add_distill_args` flags; keyword arguments (inputs, outputs, ...) are added."""
        return cls(loader, ReaderOptions.from_args(args, **kwargs))

    @property
    def student_id(self) -> str:
        return self._options.student_id

    @property
    def options(self) -> ReaderOptions:
        return self._options

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> DistillReader:
        """Connect, find teachers and check them; raises NoTeacherError / TeacherMismatchError here."""
        if self._closed:
            raise ReaderClosedError("this reader is closed; make a new one")
        if self._engine is not None:
            return self
        loop = _new_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="distill-reader", daemon=True)
        self._thread.start()

        async def boot() -> Engine:
            engine = Engine(self._options, self._out if self._submissions is None else self._submissions, self._meter)
            try:
                await engine.start()
                if self._submissions is not None:
                    engine.begin_submissions()
            except BaseException:
                await engine.close()
                raise
            return engine

        try:
            self._engine = asyncio.run_coroutine_threadsafe(boot(), loop).result()
        except BaseException:
            self._stop_loop()
            raise
        return self

    def close(self) -> None:
        """Cancel all work, close channels and registry sessions, and join the engine thread."""
        if self._closed:
            return
        self._closed = True
        if self._submissions is not None:
            self._submissions.close()
        if self._engine is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._engine.close(), self._loop).result(30)
            except Exception:
                log.exception("closing the reader's engine failed")
        # Engine.close() closed every channel and broke the engine's reference cycles (CallWatch's call
        # map, the pools' and the watch's hold on the engine, the finished epoch task), so nothing gRPC
        # waits for a garbage collection, perhaps at interpreter exit (tests/test_reader_release.py). An
        # iterator the user still holds keeps the engine object, but no channel, client or thread.
        self._engine = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> DistillReader:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_engine", None) is not None:
            self.close()

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """A new pass over the loader. Raises ReaderInUseError while another thread is inside next()."""
        if self._loader is None:
            raise TypeError("this reader has no loader: send the batches you make with reader.submit(batch) or "
                            "reader.score(batch), or give DistillReader a loader to iterate")
        self.start()
        assert self._loop is not None and self._engine is not None
        engine, loop = self._engine, self._loop
        if not self._in_next.acquire(blocking=False):
            raise _in_use()
        try:
            epoch = asyncio.run_coroutine_threadsafe(_call(engine.begin_epoch, self._loader), loop).result(30)
            self._epoch = epoch
        finally:
            self._in_next.release()
        return _Pass(self, engine, loop, epoch)

    def _next(self, p: _Pass) -> tuple[Any, Any]:
        """One item of pass `p` (see _Pass); called with `_in_next` held."""
        if self._closed:
            raise ReaderClosedError("the reader was closed during iteration")
        if p.epoch != self._epoch:
            raise StaleIteratorError(
                f"this iterator's pass was replaced by a newer iter(reader) (pass {self._epoch}); iterate the "
                "newest iterator, or give each consumer its own DistillReader")
        started = time.perf_counter()
        kind, payload = next(p.items)
        waited = time.perf_counter() - started
        if kind == END:
            raise StopIteration
        if kind == ERROR:
            raise payload
        p.engine.consumed(p.epoch)  # thread-safe; wakes the engine only when it waits for read-ahead room
        if kind == REJECTED:
            raise payload
        assert kind == BATCH
        batch, outputs, size = payload
        self._meter.record(size, waited)
        return batch, as_device(outputs, self._options.torch_device)

    # ---- batches the training loop makes (distill.submit) -------------------------------------
    def submit(self, batch: Any, *, deadline_s: float | None = None,
               temperature: float | None = None) -> concurrent.futures.Future[Any]:
        """Send `batch` to the teachers now; a future of its outputs (see ``distill.submit``). Never
        blocks: raises SubmitLimitError with `prefetch` batches unsettled. The batch's teacher inputs
        are taken on this thread (as `inputs` says); the engine keeps them until it is answered.
        `temperature`: this batch's, instead of the reader's `temperature` option."""
        subs = self._submissions
        if subs is None:
            raise TypeError("submit() is for a reader built without a loader, DistillReader(None, ...); this one "
                            "reads its loader: iterate it")
        parameters = self._temperatures(temperature)
        self.start()
        engine, loop = self._engine, self._loop
        assert engine is not None and loop is not None
        size, fields = extract_inputs(batch, self._options.inputs)
        device = self._options.torch_device
        fut = ScoreFuture(size, self._meter.record, lambda outputs: as_device(outputs, device))
        try:
            plan = engine.route(batch, size, fields)  # with route_by: its rows by service, on this thread
        except BatchRejectedError as e:  # rows that name no teacher
            fut.set_exception(e)
            return fut
        subs.add(fut)
        opts = self._options
        deadline = deadline_s if deadline_s is not None else opts.no_teacher_timeout + 2 * opts.timeout
        try:
            loop.call_soon_threadsafe(functools.partial(
                engine.submit, Submitted(fut), size, fields, deadline, parameters, plan=plan))
        except RuntimeError as e:  # the loop closed under us
            fut.set_exception(ReaderClosedError(f"the reader's engine stopped: {e}"))
        return fut

    def score(self, batch: Any, *, deadline_s: float | None = None, temperature: float | None = None) -> Any:
        """``submit(batch).result()``: the outputs of `batch`, waiting for them (staleness 0)."""
        return self.submit(batch, deadline_s=deadline_s, temperature=temperature).result()

    def stats(self) -> ReaderStats:
        """Throughput, wait fraction, and per-teacher latency/errors (see ReaderStats)."""
        if self._engine is None or self._loop is None:
            rate, wait = self._meter.figures()
            return ReaderStats(self._meter.batches, self._meter.samples, rate, wait, 0, 0, 0, 0, 0)
        stats: ReaderStats = asyncio.run_coroutine_threadsafe(_call(self._engine.stats), self._loop).result(10)
        return stats


class _Pass(Iterator[tuple[Any, Any]]):
    """The iterator of one pass: yields (batch, teacher outputs). After StopIteration or an error that
    ended the pass it stays exhausted; after a BatchRejectedError it goes on with the next batch."""

    def __init__(self, reader: DistillReader, engine: Engine, loop: asyncio.AbstractEventLoop, epoch: int) -> None:
        self.reader, self.engine, self.loop, self.epoch = reader, engine, loop, epoch
        thread = reader._thread
        self.items = reader._out.items(
            epoch, lambda: thread is not None and thread.is_alive() and not reader._closed)
        self._over = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._over:
            raise StopIteration
        lock = self.reader._in_next
        if not lock.acquire(blocking=False):
            raise _in_use()
        try:
            return self.reader._next(self)
        except (StopIteration, ReaderInUseError, StaleIteratorError):
            raise
        except BatchRejectedError:
            raise  # one batch lost; the pass goes on
        except BaseException:
            self._over = True
            raise
        finally:
            lock.release()


def _in_use() -> ReaderInUseError:
    return ReaderInUseError(
        "another thread is iterating this DistillReader right now; one reader feeds one training loop: give "
        "each thread its own reader")


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
