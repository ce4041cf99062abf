"""A model instance: one thread (and one CUDA stream on GPU) that launches whole batches, and a
finishing stage (`teacher_server.finishing`) that completes them.

The instance's thread does the device work: concatenating the requests' inputs (unless the
batcher's stager built them ahead), the host-to-device copy, the forward pass, the output
transforms (on the model's device, so only the reduced tensors are copied back) and the
device-to-host copies, which on CUDA are only enqueued (non-blocking, into pinned memory) with an
event recorded after them. It then returns to take the next batch, while the instance's
`Finisher` thread waits for that event, cuts each request's outputs and encodes them. torch
releases the GIL inside its kernels, so N instances overlap their compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from teacher_server.finishing import BatchOutputs, BatchResult, BusyClock, Finisher, Launched
from teacher_server.model import LoadedModel
from teacher_server.outputs import (
    CHUNK_BYTES,
    NamedTensor,
    OutputContext,
    transform_output,
)
from teacher_server.scoring import head_split, row_context
from teacher_server.spec import TensorSpec
from teacher_server.staging import take_staged
from teacher_server.threads import named_executor
from teacher_server.transform_rows import RowContext
from teacher_server.transforms import OutputTransform, scoreable, token_input
from teacher_server.work import Work, batch_input

__all__ = ["BatchResult", "ModelInstance", "copy_to_host"]


def unmasked(works: Sequence[Work]) -> bool:
    """Every request of the batch is real at every position it carries (its mask, counted on
    arrival by `rows.RowSplitter`, marks `batch_size x length` positions), so the batch's only
    padding is what batching added after each row's end: right padding, which a causal LM's real
    positions never attend to."""
    return all(w.useful is not None and w.length is not None and w.useful == w.batch_size * w.length
               for w in works)


def finite_rows(outs: Sequence[torch.Tensor], specs: Sequence[TensorSpec],
                works: Sequence[Work]) -> torch.Tensor | None:
    """Whether the model's floating outputs are finite, per row of the batch `[B]`, on the
    outputs' device and before any transform: a top-k or log-softmax of an overflowed row would
    hide or spread it. Where requests of different lengths share a padded batch it is per row and
    position `[B, T]` instead, so the padding computed past a request's length (which some models
    fill with inf or NaN) is not held against it (`BatchOutputs.nonfinite` cuts it).

    One reduction per output and no copy of it: a sum accumulated in float32 (or wider) is not
    finite when any value summed is not (inf and NaN propagate), so a row is flagged also when its
    finite values sum past float32's range, which no usable output does. None when no output is
    floating."""
    ragged = len({w.length for w in works}) > 1
    rows: list[torch.Tensor] = []  # [B] each
    positions: list[torch.Tensor] = []  # [B, T] each
    for o, spec in zip(outs, specs, strict=True):
        if not o.is_floating_point():
            continue
        axis = spec.shape.index(-1) + 1 if ragged and spec.per_position else None
        dims = [d for d in range(1, o.dim()) if d != axis]
        ok = torch.isfinite(o.sum(dim=dims, dtype=torch.promote_types(o.dtype, torch.float32)) if dims else o)
        (rows if axis is None else positions).append(ok)
    if positions and any(p.shape != positions[0].shape for p in positions):
        rows += [p.all(dim=1) for p in positions]  # per-position outputs of different lengths: whole rows
        positions = []
    found = [*rows, *positions]
    if not found:
        return None
    result = found[0]
    for ok in found[1:]:
        result = result & ok if ok.dim() == result.dim() else (result.unsqueeze(1) & ok if ok.dim() > 1
                                                               else result & ok.unsqueeze(1))
    return result


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of a transformed output. From CUDA it is enqueued on the
    current stream into pinned host memory and not waited for: the tensor holds the data once the
    batch's event has completed (`Finisher.finish` waits for it). A CPU tensor is returned as is."""
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.to("cpu")
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class ModelInstance:
    """Launches batches of one LoadedModel on a dedicated thread; a `Finisher` completes them."""

    def __init__(self, model: LoadedModel, index: int, max_batch_size: int, *, chunk_bytes: int = CHUNK_BYTES,
                 device_clock: BusyClock | None = None) -> None:
        """`device_clock`: shared by the instances on one device, so each batch's `device_ns` counts
        only the device time no other instance's batch already held (None: this instance's own)."""
        self.model = model
        self.index = index
        self._executor = named_executor(f"instance-{index}")
        self._finisher = Finisher(index, device_clock)
        self._stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self._staging = self._pinned_staging(max_batch_size) if self._stream is not None else None
        self._staging_read: torch.cuda.Event | None = None  # recorded after the last copies out of _staging
        self._spec_index = {s.name: i for i, s in enumerate(model.io.outputs)}
        self._split = head_split(model.module)
        # Whether a separable model's output projection runs a chunk of positions at a time (benchmarks
        # turn it off to compare), and the fp32 bytes of one chunk (outputs.OutputContext; --output-chunk-mb).
        self.chunked = True
        self.chunk_bytes = chunk_bytes
        self._token = token_input(model.io)
        mask = model.io.attention_mask
        self._mask = next((i for i, s in enumerate(model.io.inputs) if s.name == mask), None)
        # The mask may be left out of a right-padded batch (see `unmasked`) when the module says so.
        self._unmask = self._mask if getattr(model.module, "causal_mask_only", False) is True else None
        self._lock = threading.Lock()
        self._unfinished = 0  # batches launched (or launching) and not finished

    def _pinned_staging(self, max_batch_size: int) -> list[torch.Tensor | None]:
        """Pinned host buffers per input, so a batch is assembled once and copied to the GPU async."""
        bufs: list[torch.Tensor | None] = []
        for s in self.model.io.inputs:
            if -1 in s.shape:
                bufs.append(None)
            else:
                bufs.append(torch.empty((max_batch_size, *s.shape), dtype=s.torch_dtype, pin_memory=True))
        return bufs

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._executor

    @property
    def busy(self) -> bool:
        """A batch is being launched on this instance's thread or waits to be finished."""
        return self._unfinished > 0

    def _count(self, delta: int) -> None:
        with self._lock:
            self._unfinished += delta

    def launch(self, works: Sequence[Work], pipelined: bool = True) -> Future[BatchResult]:
        """Enqueue one batch's device work and host copies (called on this instance's thread) and
        return its result's future. `pipelined`: the batch is finished on the finishing stage's
        thread and this returns as soon as it is enqueued; else it is finished here and the
        future is done when this returns. An error of the forward pass or the transforms raises
        here; one of the finishing fails the future."""
        start = time.perf_counter_ns()
        self._count(1)
        try:
            launched = self._launch(works, start)
            if pipelined:
                done = self._finisher.submit(launched)
            else:
                done = Future()
                try:
                    done.set_result(self._finisher.finish(launched))
                except Exception as e:
                    done.set_exception(e)
        except BaseException:
            self._count(-1)
            raise
        done.add_done_callback(lambda _: self._count(-1))
        return done

    def run(self, works: Sequence[Work]) -> BatchResult:
        """Run one batch to its end on the calling thread (tests, benchmarks, tools)."""
        return self.launch(works, pipelined=False).result()

    def _launch(self, works: Sequence[Work], start_ns: int) -> Launched:
        with torch.inference_mode():
            if self._stream is None:
                return Launched(self._execute(self._gather(works), works).map(copy_to_host), None, start_ns)
            with torch.cuda.stream(self._stream):
                host = self._execute(self._gather_cuda(works), works).map(copy_to_host)
                event = torch.cuda.Event(blocking=True)  # the finishing thread sleeps, not spins, on it
                event.record(self._stream)
            return Launched(host, event, start_ns)

    def _execute(self, xs: list[torch.Tensor], works: Sequence[Work]) -> BatchOutputs:
        """The forward pass and the transforms. A model with a separable output projection (an
        hf: causal LM) returns its final hidden states instead when every request wants that
        output reduced (top-k, scores): the transforms then apply the projection a chunk of
        positions at a time, and the full logits never exist."""
        model_xs: list[torch.Tensor | None] = list(xs)
        if self._unmask is not None and unmasked(works):
            model_xs[self._unmask] = None
        split = self._split
        if split is not None and self.chunked and all(
                want.reduces(bool(w.aux)) for w in works for want in w.outputs if want.name == split.head_output):
            return self._transform(split.hidden(*model_xs), works, xs, split.head)
        return self._transform(self.model.forward(model_xs), works, xs, None)

    def _gather(self, works: Sequence[Work]) -> list[torch.Tensor]:
        if (staged := take_staged(works)) is not None:  # built ahead by the batcher's stager
            return staged
        if len(works) == 1:
            return [x.to(self.model.device) for x in works[0].inputs]  # zero-copy on CPU
        n_inputs = len(works[0].inputs)
        return [batch_input(works, i).to(self.model.device) for i in range(n_inputs)]

    def _gather_cuda(self, works: Sequence[Work]) -> list[torch.Tensor]:
        assert self._staging is not None
        if (staged := take_staged(works)) is not None:  # built and copied ahead by the batcher's stager
            return staged
        total = sum(w.batch_size for w in works)
        if self._staging_read is not None:
            # The last batch's copies out of the reused buffers may still be queued behind an
            # earlier batch (launches do not wait for their batch): wait for them before refilling.
            self._staging_read.synchronize()
            self._staging_read = None
        xs = []
        for i, buf in enumerate(self._staging):
            if buf is None or total > buf.shape[0]:
                host = batch_input(works, i, pin=True)  # fresh pinned memory: torch tracks its copy
            else:
                host = buf[:total]
                torch.cat([w.inputs[i] for w in works], out=host)
                self._staging_read = torch.cuda.Event(blocking=True)
            xs.append(host.to(self.model.device, non_blocking=True))
        if self._staging_read is not None:
            self._staging_read.record()
        return xs

    def _transform(self, outs: list[torch.Tensor], works: Sequence[Work], xs: list[torch.Tensor],
                   head: Callable[[torch.Tensor], torch.Tensor] | None) -> BatchOutputs:
        """The batch's transformed outputs, on the device the outputs live on (only these are
        copied to the host). When every request of the batch wants the same transforms (the usual
        case), they run once on the whole batch and each request's rows are cut from the host
        tensors when the batch is finished."""
        specs = self.model.io.outputs
        finite = finite_rows(outs, specs, works)
        first = works[0].outputs
        if all(w.outputs == first and w.aux.keys() == works[0].aux.keys() for w in works[1:]):
            rows = self._row_context(xs, works, outs, first)
            return BatchOutputs(works, whole=[(name, t, specs[self._spec_index[want.name]])
                                              for want in first for name, t in self._apply(outs, want, rows, head)],
                                finite=finite)
        result: list[list[NamedTensor]] = []
        offset = 0
        for w in works:
            named: list[NamedTensor] = []
            cut = [w.cut(o[offset : offset + w.batch_size], s) for o, s in zip(outs, specs, strict=True)]
            rows = self._row_context([x[offset : offset + w.batch_size] for x in xs], [w], cut, w.outputs)
            for want in w.outputs:
                named.extend(self._apply(cut, want, rows, head))
            result.append(named)
            offset += w.batch_size
        return BatchOutputs(works, per_request=result, finite=finite)

    def _apply(self, outs: list[torch.Tensor], want: OutputTransform, rows: RowContext | None,
               head: Callable[[torch.Tensor], torch.Tensor] | None) -> list[NamedTensor]:
        i = self._spec_index[want.name]
        spec = self.model.io.outputs[i]
        use_head = head is not None and self._split is not None and want.name == self._split.head_output
        if not (use_head or (rows is not None and scoreable(spec)) or self.chunk_bytes != CHUNK_BYTES):
            return transform_output(outs[i], spec, want)
        context = OutputContext(rows if scoreable(spec) else None, head if use_head else None,
                                spec.shape[-1] if spec.shape else 0, self.chunk_bytes)
        return transform_output(outs[i], spec, want, context)

    def _row_context(self, xs: list[torch.Tensor], works: Sequence[Work], outs: list[torch.Tensor],
                     wants: Sequence[OutputTransform]) -> RowContext | None:
        """The scoring transforms' view of the batch's positions (flattened [rows x length]): next
        tokens, which positions are real, and the score ids padded to the longest m."""
        if self._token is None or not (any(w.needs_tokens for w in wants) or works[0].aux):
            return None
        length = next((o.shape[s.shape.index(-1) + 1] for o, s in zip(outs, self.model.io.outputs, strict=True)
                       if scoreable(s)), None)
        if length is None:
            return None
        return row_context(xs[self._token][:, :length],
                           None if self._mask is None else xs[self._mask][:, :length], works, length)

    def close(self, wait: bool = True) -> None:
        """Stop the instance's thread, then its finishing stage; with wait=False, return at once and
        leave a running batch behind (a forward pass cannot be interrupted; its thread ends when
        the pass does). Batches not yet started are cancelled: their futures say so."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._finisher.close(wait)
