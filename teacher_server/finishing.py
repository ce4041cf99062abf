"""A batch's last steps, off the instance's thread: wait for its outputs to reach the host, cut
each request's share out of them and encode it, while the instance already runs the next batch.

Without this stage an instance runs input copy, forward pass, transforms, device-to-host copy and
encoding one after another on its one thread, so on a GPU the device idles while the host copies
and encodes each batch. Instead the instance thread only enqueues the device work and the copies
(non-blocking, into pinned host memory, on the instance's CUDA stream), records a CUDA event after
them and hands the batch (`Launched`) to its `Finisher`: one thread per instance that waits on the
event (a host wait for that batch only; the stream runs on), cuts and encodes, and resolves the
batch's future. On CPU the outputs are host tensors when the forward pass returns; finishing batch
n (cutting and encoding) then overlaps batch n+1's forward pass.

The batcher bounds how many batches an instance has launched and not finished
(`teacher_server.batcher`), so the outputs waiting here are bounded too. Batches finish in launch
order (one thread), which is what makes the compute-time accounting below a simple running
maximum.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from protos.kserve import tensor_bytes
from protos.outputs import SCORE_IDS, SCORED_LOGPROBS
from teacher_server.outputs import EncodedOutput, NamedTensor, encode_named
from teacher_server.spec import TensorSpec
from teacher_server.threads import named_executor
from teacher_server.work import Work

WholeOutput = tuple[str, torch.Tensor, TensorSpec]
"""One transformed output of a whole batch: (name, tensor, the model output's spec)."""


@dataclass
class BatchResult:
    """Each request's encoded outputs, in batch order, and the batch's compute time.

    compute_ns is the time this batch held its instance that no earlier batch of the instance
    already held (from its start, or from the previous batch's end if that came later, to its
    end): with batches overlapping, their compute times add up to the instance's busy time, which
    is what the load figures and the autoscaler divide by."""

    per_request: list[list[EncodedOutput]]
    compute_ns: int
    # The device's share: to the batch's outputs being ready (before they are encoded), counted
    # against every batch of the instances that share the device (`BusyClock`): with two instances
    # on one GPU, an instance's compute time also holds the other's batches, this does not. The
    # batch cost fit (`teacher_server.batch_cost`) reads it.
    device_ns: int = 0
    # Per request (batch order): its rows whose outputs are not all finite (`BatchOutputs.nonfinite`).
    nonfinite: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class BatchOutputs:
    """A batch's transformed outputs before they are cut per request. `whole`: each output for
    the whole batch (the usual case: every request wants the same transforms); else
    `per_request`: each request's outputs, already its own. `finite`: per row of the batch
    (`[B]`), or per row and position (`[B, T]`) where requests of different lengths share a padded
    batch, whether the model's floating outputs there are finite (`instance.finite_rows`); None
    when the model has no floating output."""

    works: Sequence[Work]
    whole: list[WholeOutput] | None = None
    per_request: list[list[NamedTensor]] | None = None
    finite: torch.Tensor | None = None

    def map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> BatchOutputs:
        """The same outputs with `f` applied to every tensor (the copies to the host)."""
        if self.whole is not None:
            whole = [(n, f(t), s) for n, t, s in self.whole]
            return BatchOutputs(self.works, whole=whole, finite=None if self.finite is None else f(self.finite))
        assert self.per_request is not None
        per_request = [[(n, f(t)) for n, t in r] for r in self.per_request]
        return BatchOutputs(self.works, per_request=per_request, finite=None if self.finite is None else f(self.finite))

    def nonfinite(self) -> list[tuple[int, ...]]:
        """Each request's rows (its own numbering) with a non-finite output value at a position it
        keeps (a padded batch's positions past a request's length are not its own). A host
        tensor: read once the batch's copies are done."""
        f = self.finite
        if f is None or bool(f.all()):
            return [()] * len(self.works)
        result: list[tuple[int, ...]] = []
        offset = 0
        for w in self.works:
            mine = f[offset : offset + w.batch_size]
            if mine.dim() > 1:
                mine = mine[:, : w.length].all(dim=1)
            result.append(tuple((~mine).nonzero().flatten().tolist()))
            offset += w.batch_size
        return result

    def encoded(self) -> list[list[EncodedOutput]]:
        """Each request's outputs, encoded for the wire (host tensors: read once the batch's copies
        are done). A whole-batch output of which every request takes whole rows is laid out once
        and each request's bytes are a slice of it, copied: per request one slice instead of a
        tensor's encoding, and an answer waiting on a slow client holds its own rows, never the
        batch's. A batch of one request answers with a view of the output, no copy, unless the
        output views more memory than its own or is pinned (a GPU batch's host copy, which goes
        back to torch's pool of page-locked memory as soon as the batch is finished)."""
        if self.whole is None:
            return [encode_named(named) for named in self.split()]
        columns = [self._encode_whole(name, t, spec) for name, t, spec in self.whole]
        return [list(answer) for answer in zip(*columns, strict=True)]

    def _encode_whole(self, name: str, t: torch.Tensor, spec: TensorSpec) -> list[EncodedOutput]:
        """One whole-batch output, encoded per request (batch order)."""
        out: list[EncodedOutput] = []
        offset = 0
        if t.numel() == 0 or any(_cut(w, name, t, spec).shape != t.shape for w in self.works):
            for w in self.works:
                out.extend(encode_named([(name, _cut(w, name, t[offset : offset + w.batch_size], spec))]))
                offset += w.batch_size
            return out
        t = t.contiguous()
        dtype, raw = tensor_bytes(t)
        tail = list(t.shape[1:])
        if len(self.works) == 1 and t.untyped_storage().nbytes() == len(raw) and not t.is_pinned():
            return [(name, dtype, [self.works[0].batch_size, *tail], raw)]
        row = len(raw) // t.shape[0]
        for w in self.works:
            end = offset + w.batch_size
            out.append((name, dtype, [w.batch_size, *tail], raw[offset * row : end * row].tobytes()))
            offset = end
        return out

    def split(self) -> list[list[NamedTensor]]:
        """Each request's outputs: its rows of the whole-batch tensors cut back to its length
        (views, no copies)."""
        if self.whole is None:
            assert self.per_request is not None
            return self.per_request
        result: list[list[NamedTensor]] = []
        offset = 0
        for w in self.works:
            result.append([(name, _cut(w, name, t[offset : offset + w.batch_size], spec))
                           for name, t, spec in self.whole])
            offset += w.batch_size
        return result


@dataclass
class Launched:
    """A batch whose device work and host copies are enqueued: `outputs` are host tensors, valid
    once `event` (a torch.cuda.Event on the instance's stream; None on CPU) has completed."""

    outputs: BatchOutputs
    event: Any
    start_ns: int


class BusyClock:
    """The end of the last batch finished on one instance, or on one device across its instances;
    `claim` counts a batch's time from its start or that end, whichever came later, so overlapping
    batches' times add up to the busy time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_end_ns = 0

    def claim(self, start_ns: int, end_ns: int) -> int:
        with self._lock:
            ns = end_ns - max(start_ns, self._last_end_ns)
            self._last_end_ns = max(end_ns, self._last_end_ns)
        return max(ns, 0)


class Finisher:
    """One instance's finishing stage: its own thread, owned by the instance and shut down with it."""

    def __init__(self, index: int, device: BusyClock | None = None) -> None:
        """`device`: the clock shared by the instances on this instance's device (None: its own)."""
        self._executor = named_executor(f"finish-{index}")
        self._own = BusyClock()
        self._device = device if device is not None else BusyClock()

    def submit(self, launched: Launched) -> Future[BatchResult]:
        """Finish `launched` on this stage's thread, after the batches submitted before it."""
        return self._executor.submit(self.finish, launched)

    def finish(self, launched: Launched) -> BatchResult:
        """Wait for the batch's copies, cut and encode each request's outputs (on any thread:
        the stage's, or the instance's when finishing is not asynchronous)."""
        if launched.event is not None:
            launched.event.synchronize()
        ready = time.perf_counter_ns()  # the device is done with the batch; the host's encoding follows
        with torch.inference_mode():
            per_request = launched.outputs.encoded()
            nonfinite = launched.outputs.nonfinite()
        compute_ns = self._own.claim(launched.start_ns, time.perf_counter_ns())
        return BatchResult(per_request, compute_ns, self._device.claim(launched.start_ns, ready), nonfinite)

    def close(self, wait: bool = True) -> None:
        """Stop the thread; batches not yet being finished are cancelled (their futures say so)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)


def _cut(w: Work, name: str, t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A request's rows of a whole-batch output, cut back to its length (and its own number of
    score ids)."""
    t = w.cut(t, spec)
    scores = w.aux.get(SCORE_IDS.name)
    if scores is not None and name.endswith(SCORED_LOGPROBS.suffix) and t.shape[-1] != scores.shape[-1]:
        t = t.narrow(-1, 0, scores.shape[-1])
    return t
