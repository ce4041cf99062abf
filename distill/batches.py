"""A user's batch inside the reader (pulled from the loader on a thread of its own by
`distill.readahead`): its teacher inputs found inside whatever the loader yields
(`distill.batch_fields`), split into chunks for teachers (`Job`, `Chunk`), the answers copied into
the batch's tensors (a text batch's chunks of other widths padded to its widest:
`distill.text_fields`), and the batch handed to the reader's sink exactly once, in loader order
(`Delivery`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from distill.batch_fields import extract_inputs, signature_of
from distill.errors import BatchRejectedError, InputRefusal, NonFiniteOutputError
from distill.outputs import VALID_ROWS
from distill.readahead import ReadAhead
from distill.routing_keys import Routed
from distill.teacher_client import MalformedAnswerError
from distill.text_fields import pad_value, widen
from distill.types import FieldArray, OutputCache, ParameterValue, Signature, StoredRows

__all__ = ["Chunk", "Delivery", "Job", "Sink", "Submitted", "extract_inputs", "signature_of"]

log = logging.getLogger("distill.reader")

class Submitted:
    """A batch the training loop handed to ``submit``: its outputs settle `future` (on the engine's
    thread) instead of going to the sink. A future cancelled meanwhile is left as it is. `timer`, the
    batch's deadline, is cancelled when it settles (it holds the batch's outputs until it fires)."""

    __slots__ = ("future", "timer")

    def __init__(self, future: Any) -> None:
        self.future = future
        self.timer: asyncio.TimerHandle | None = None

    def settle(self, outputs: Any, error: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(outputs)
        except Exception:  # cancelled, or already failed by close(): nobody waits for it
            pass


class Sink(Protocol):
    """Where finished work goes: the reader's queue to the training loop (`distill.reader`)."""

    def batch(self, epoch: int, batch: Any, outputs: Any, size: int) -> None: ...

    def end(self, epoch: int) -> None: ...

    def error(self, epoch: int, error: BaseException) -> None: ...

    def rejected(self, epoch: int, error: BaseException) -> None:
        """This one batch failed (`BatchRejectedError`) in its place in the order; the epoch goes on."""


@dataclass(eq=False)
class Job:
    epoch: int
    seq: int
    batch: Any = None
    size: int = 0
    fields: dict[str, FieldArray] = field(default_factory=dict)
    signature: Signature = ()
    remaining: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, dict[str, torch.Tensor] | None] = field(default_factory=dict)
    error: BaseException | None = None
    delivered: bool = False
    cached: StoredRows | None = None  # with a cache: the batch's keys, and what the store held
    # A submitted batch's own request parameters (its temperature, `DistillReader.submit`); None:
    # the reader's. Only batches with the same parameters share a request (distill.bundles).
    parameters: Mapping[str, ParameterValue] | None = None
    # With route_by: the routed batch this job belongs to (distill.routing_rows), as the whole batch or
    # as one service's rows of it; None when every row goes to every service.
    routed: Routed | None = None

    @property
    def text(self) -> bool:
        """Whether the batch sends texts: its chunks' answers may differ in width (`distill.text_fields`)."""
        return any(dtype == "BYTES" for _, dtype, _ in self.signature)

    @property
    def sent(self) -> int:
        """Rows that go to the teachers: the store's misses with a cache, else the whole batch."""
        return self.size if self.cached is None else len(self.cached.miss_indices)


@dataclass(eq=False)
class Chunk:
    job: Job
    service: str
    start: int
    stop: int
    done: bool = False
    winner: str = ""
    sends: set[asyncio.Task[None]] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    refusals: dict[str, str] = field(default_factory=dict)  # teacher key -> what it said of this input
    suspect: bool = False  # refused once: goes through the service's suspect lane
    alone: bool = False  # in a request that was refused: never shares a call again (distill.bundles)
    refusal: InputRefusal | None = None  # what a teacher that refused it found wrong (rows of the batch)

    @property
    def size(self) -> int:
        return self.stop - self.start


def _owned_copy(t: torch.Tensor) -> torch.Tensor:
    """A writable copy of an answer's tensor, made by numpy where it can: on the engine's thread a
    torch operation releases and retakes the GIL (a handoff to the training loop's thread)."""
    if t.dtype is torch.bfloat16:
        return t.clone()
    return torch.from_numpy(t.numpy().copy())


class Delivery:
    """Answers into a batch's tensors, and finished batches to the sink exactly once: in loader
    order (`ordered`), or as they finish. One per engine; `reset` at each epoch."""

    def __init__(self, sink: Sink, *, ordered: bool, services: Sequence[str], pin_memory: bool) -> None:
        self.sink = sink
        self.ordered = ordered
        self.services = tuple(services)
        self.pin_memory = pin_memory
        self.cache: OutputCache | None = None  # the teacher-output store, when the reader has one
        # A batch a teacher answered with inf or NaN in some rows fails (NonFiniteOutputError) or,
        # with hard labels, goes on without that service's outputs; else it is delivered with
        # VALID_ROWS marking them (ReaderOptions.nonfinite, set by the dispatcher).
        self.refuse_nonfinite = True
        self.hard_labels = False
        self.epoch = 0
        self.ready: dict[int, Job] = {}
        self.next_seq = 0
        self.end_seq: int | None = None
        self.row_bytes = 0.0  # the most bytes a row of an answered batch has held: its teacher inputs and outputs
        self.on_row_bytes: Callable[[], None] | None = None  # called when row_bytes grows (the read-ahead's bound)
        self.routed = False  # route_by: each row from its own service, one dict of outputs per batch
        # The pass's read-ahead slots: answered batches waiting in `ready` for an earlier one lend
        # theirs to the loader meanwhile (`ReadAhead.waiting`), so a slow batch does not hold back
        # the calls of the batches behind it; so do a few delivered ones until the loop takes them.
        self.slots: ReadAhead | None = None
        self._waiting = 0  # len(ready) as the slots last heard it
        self._handed = 0  # batches handed to the training loop since the slots last heard

    def reset(self, epoch: int, slots: ReadAhead | None = None) -> None:
        """A new pass, `epoch`, reading ahead by `slots`."""
        self.epoch = epoch
        self.ready = {}
        self.next_seq = 0
        self.end_seq = None
        self.slots = slots
        self._waiting = 0
        self._handed = 0

    def end_at(self, seq: int) -> None:
        """The loader ended after `seq` batches: the epoch ends once they are delivered."""
        self.end_seq = seq
        self.flush()

    def fail_at(self, epoch: int, seq: int, error: BaseException) -> None:
        """The loader failed at batch `seq`: the error takes its place, and the epoch ends there."""
        if epoch != self.epoch:
            return
        self.ready[seq] = Job(epoch, seq, error=error)
        self.end_seq = seq + 1
        self.flush()

    @staticmethod
    def check_fits(chunk: Chunk, outputs: dict[str, torch.Tensor]) -> None:
        """An answer must match the answers already in the batch's tensors (outputs whose metadata
        leaves a dimension open, -1, can still disagree between teachers)."""
        dest = chunk.job.outputs.get(chunk.service)
        skip = 2 if chunk.job.text else 1  # a text batch's chunks may differ in positions
        for name, value in outputs.items():
            buf = None if dest is None else dest.get(name)
            if buf is not None and (buf.dim() != value.dim() or buf.shape[skip:] != value.shape[skip:]):
                raise MalformedAnswerError(f"output {name!r} came as {list(value.shape[1:])} per sample; the "
                                           f"batch's other chunks have {list(buf.shape[1:])}")

    def whole(self, chunk: Chunk) -> bool:
        """Whether `chunk` answers its whole batch (the common case): its answer's tensors then become
        the batch's own, as they are if the client was asked for tensors the reader may keep
        (`ChunkRequest.owned`), else copied out of the response's read-only buffer."""
        job = chunk.job
        cached = job.cached
        return (chunk.size == job.size and not self.pin_memory
                and (cached is None or len(cached.miss_indices) == job.size))

    def fill(self, chunk: Chunk, outputs: dict[str, torch.Tensor], owned: bool = False) -> bool:
        """Copy an answer into the batch's tensors (`owned`: the client returned tensors the batch may
        keep, asked for when the chunk is `whole`). True when this completed the batch and refused it
        for rows of inf or NaN (count it as rejected)."""
        job = chunk.job
        if job.epoch != self.epoch or job.delivered or job.error is not None:
            return False
        dest = job.outputs.setdefault(chunk.service, {})
        if dest is None:  # this service already fell back to hard labels for the batch
            return False
        if (valid := outputs.get(VALID_ROWS)) is not None:  # rows holding inf or NaN: kept as a mask
            outputs = {n: v for n, v in outputs.items() if n != VALID_ROWS}
            if not bool(valid.all()):  # (a bundle's answer marks the rows of all its batches)
                mask = dest.get(VALID_ROWS)
                if mask is None:
                    mask = dest[VALID_ROWS] = torch.ones(job.size, dtype=torch.bool)
                mask[self._batch_rows(chunk)] = valid
        if self.whole(chunk):
            for name, value in outputs.items():
                dest[name] = value if owned else _owned_copy(value)
            job.remaining[chunk.service] -= chunk.size
            return self.maybe_complete(job)
        cached = job.cached
        rows = None if cached is None or len(cached.miss_indices) == job.size else torch.from_numpy(
            cached.miss_indices[chunk.start:chunk.stop])
        text = job.text
        for name, value in outputs.items():
            buf = dest.get(name)
            if buf is None:
                shape = (job.size, *value.shape[1:])
                buf = (torch.full(shape, pad_value(name), dtype=value.dtype, pin_memory=self.pin_memory) if text
                       else torch.empty(shape, dtype=value.dtype, pin_memory=self.pin_memory))
                if rows is not None:  # a partial hit: the stored rows go in their places in the batch
                    assert cached is not None
                    buf[torch.from_numpy(cached.hit_indices)] = cached.fit(name, value)
                dest[name] = buf
            if text and value.dim() >= 2 and value.shape[1] != buf.shape[1]:  # chunks of other widths
                if value.shape[1] > buf.shape[1]:
                    buf = dest[name] = widen(buf, value.shape[1], name)
                buf[chunk.start:chunk.stop, :value.shape[1]].copy_(value)
            elif rows is None:
                buf[chunk.start:chunk.stop].copy_(value)
            else:
                buf[rows] = value
        job.remaining[chunk.service] -= chunk.size
        return self.maybe_complete(job)

    def _batch_rows(self, chunk: Chunk) -> slice | torch.Tensor:
        """Where the chunk's rows sit in its batch: a span, or with a store's partial hit the
        missing rows it carries."""
        cached = chunk.job.cached
        if cached is None or len(cached.miss_indices) == chunk.job.size:
            return slice(chunk.start, chunk.stop)
        return torch.from_numpy(cached.miss_indices[chunk.start:chunk.stop])

    def reject(self, chunk: Chunk, reason: str, *, hard_labels: bool, error: BatchRejectedError | None = None) -> bool:
        """The teachers refused `chunk`: its batch fails alone (`error`, else a `BatchRejectedError`
        naming `reason`, in its place in the order), or under hard labels goes on without this
        service's outputs. True when this settles the batch (count it), False when it was settled already."""
        job, service = chunk.job, chunk.service
        if job.delivered:
            return False
        what = f"batch {job.seq} of this pass (rows {chunk.start}..{chunk.stop - 1})"
        counted = False
        if hard_labels:
            if job.outputs.get(service, {}) is not None:
                counted = True
                log.warning("service %r refused %s; it goes on with hard labels: %s", service, what, reason)
            job.outputs[service] = None
            job.remaining[service] = 0
        else:
            if job.error is None:
                counted = True
                log.warning("service %r refused %s: %s", service, what, reason)
                job.error = error or BatchRejectedError(
                    f"service {service!r} refused {what}: {reason}. Only this batch is lost and the teachers "
                    "keep serving: check this batch's inputs, catch BatchRejectedError around next() to skip "
                    "such batches, or pass fallback='hard_labels' to train on them with labels alone.",
                    reason=reason, refusal=chunk.refusal)
            job.remaining = dict.fromkeys(job.remaining, 0)
        self.maybe_complete(job)
        return counted

    def from_store(self, job: Job, *, hard_labels: bool) -> str:
        """Settle a batch from the store when no teacher is needed: all its samples are stored
        ("stored"), or some are missing and there is no teacher to ask: an error naming the key
        ("missing"), or the batch without outputs ("hard_labels"). "" when teachers must answer."""
        cached = job.cached
        assert cached is not None and self.cache is not None
        name = self.services[0] if self.services else "cache"
        if cached.all_hit:
            job.outputs[name] = dict(cached.outputs)
            settled = "stored"
        elif self.services:
            return ""
        elif hard_labels:
            log.warning("batch %d has samples missing from the store and there is no teacher: it goes on with "
                        "hard labels", job.seq)
            job.outputs[name] = None
            settled = "hard_labels"
        else:
            job.error = self.cache.miss_error(cached, job.seq)
            settled = "missing"
        job.fields = {}
        self.maybe_complete(job)
        return settled

    def _measure(self, job: Job) -> None:
        """Count what a row of `job`, answered, holds (its inputs and outputs) towards `row_bytes`."""
        if not job.size or job.error is not None:
            return
        held = sum(f.array.nbytes for f in job.fields.values())
        held += sum(t.nbytes for outs in job.outputs.values() if outs for t in outs.values())
        if held / job.size > self.row_bytes:
            self.row_bytes = held / job.size
            if self.on_row_bytes is not None:
                self.on_row_bytes()

    def _refused_nonfinite(self, job: Job) -> bool:
        """Whether a service answered rows of the completed `job` with inf or NaN; if so the batch
        fails naming them all, or under hard labels goes on without that service's outputs."""
        refused = False
        for service, outs in list(job.outputs.items()):
            mask = None if outs is None else outs.get(VALID_ROWS)
            if mask is None or job.error is not None:
                continue
            error = NonFiniteOutputError(service, job.seq, tuple((~mask).nonzero().flatten().tolist()))
            refused = True
            log.warning("%s%s", error, " It goes on with hard labels." if self.hard_labels else "")
            if self.hard_labels:
                job.outputs[service] = None
            else:
                job.error = error
        return refused

    def maybe_complete(self, job: Job) -> bool:
        """Hand a batch whose answers are all in to the sink (in order); True when it was refused
        for rows of inf or NaN."""
        if job.delivered or any(job.remaining.values()):
            return False
        refused = self.refuse_nonfinite and job.error is None and self._refused_nonfinite(job)
        if job.routed is not None:
            if job.routed.batch is not job:  # one service's rows: into the batch, which completes when all are in
                job.delivered = True
                job.fields = {}
                job.routed.part_done(job, self)
                return refused
            job.routed.merge()
        self._measure(job)
        job.fields = {}  # the inputs are no longer needed; free them before the loop takes the batch
        self._write_back(job)
        if self.ordered:
            self.ready[job.seq] = job
        else:
            self._deliver(job)
            self.next_seq += 1
        self.flush()
        return refused

    def _write_back(self, job: Job) -> None:
        """The teachers' rows of a completed batch go to the store's writer thread (never blocking)."""
        cache, cached = self.cache, job.cached
        if cache is None or cached is None or cache.mode == "read" or job.error is not None or cached.all_hit:
            return
        answered = next(iter(job.outputs.values()), None) if self.services else None
        if not answered:
            return  # hard labels: nothing to store
        miss = torch.from_numpy(cached.miss_indices)
        keys = cached.missing_keys()
        if (valid := answered.get(VALID_ROWS)) is not None:  # rows with inf or NaN are never stored
            kept = valid.index_select(0, miss).nonzero().squeeze(1)
            miss = miss.index_select(0, kept)
            keys = keys[kept.numpy()] if isinstance(keys, np.ndarray) else [keys[i] for i in kept.tolist()]
        cache.write_back(keys, {n: t.index_select(0, miss) for n, t in answered.items() if n != VALID_ROWS})

    def flush(self) -> None:
        if self.ordered:
            while self.next_seq in self.ready:
                job = self.ready.pop(self.next_seq)
                self.next_seq += 1
                if job.error is not None and not isinstance(job.error, BatchRejectedError):
                    self.sink.error(job.epoch, job.error)
                    return
                self._deliver(job)
        self._tell_slots()
        if self.end_seq is not None and self.next_seq >= self.end_seq:
            if self.cache is not None:  # the pass's answers become readable by the next pass
                self.cache.seal()
            self.sink.end(self.epoch)
            self.end_seq = None

    def _tell_slots(self) -> None:
        """Tell the read-ahead slots how many answered batches wait and how many were handed to the
        training loop since they last heard: once a turn (`flush`), not once a batch; the loop takes
        a batch only after the turn that delivered it (`distill.reader.Outbox`)."""
        if self.slots is not None and (self._handed or len(self.ready) != self._waiting):
            self._waiting = len(self.ready)
            self.slots.waiting(self._waiting, delivered=self._handed)
            self._handed = 0

    def _deliver(self, job: Job) -> None:
        job.delivered = True
        if isinstance(job.batch, Submitted):
            job.batch.settle(None if job.error else self._outputs_of(job), job.error)
            return
        self._handed += 1  # its slot is lent until the training loop takes it (ReadAhead.waiting)
        if job.error is not None:
            self._tell_slots()  # before the loop can take it: a rejection goes at once
            self.sink.rejected(job.epoch, job.error)
            return
        self.sink.batch(job.epoch, job.batch, self._outputs_of(job), job.size)

    def _outputs_of(self, job: Job) -> Any:
        if len(self.services) > 1 and not self.routed:
            return dict(job.outputs)
        return next(iter(job.outputs.values()))
