"""A model instance: one thread (and one CUDA stream on GPU) that executes whole batches.

Everything heavy happens here, off the event loop: concatenating the requests' inputs, the
host-to-device copy, the forward pass, the output transforms (on the model's device, so only the
reduced tensors are copied back), the device-to-host copy, and splitting + encoding each request's
outputs. torch releases the GIL inside its kernels, so N instances overlap their compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from teacher_server.model import LoadedModel
from teacher_server.outputs import (
    CHUNK_BYTES,
    EncodedOutput,
    NamedTensor,
    OutputContext,
    encode_named,
    transform_output,
)
from teacher_server.scoring import head_split, row_context
from teacher_server.spec import TensorSpec
from teacher_server.staging import take_staged
from teacher_server.transform_rows import RowContext
from teacher_server.transforms import OutputTransform, scoreable, token_input
from teacher_server.work import Work, batch_input


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of a transformed output (synchronous: the batch is done when it
    returns); a CPU tensor is returned as is."""
    return t if t.device.type == "cpu" else t.to("cpu")


@dataclass
class BatchResult:
    """Each request's encoded outputs, in batch order, and the batch's compute time."""

    per_request: list[list[EncodedOutput]]
    compute_ns: int


class ModelInstance:
    """Executes batches of one LoadedModel on a dedicated thread."""

    def __init__(self, model: LoadedModel, index: int, max_batch_size: int) -> None:
        self.model = model
        self.index = index
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"instance-{index}")
        self._stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self._staging = self._pinned_staging(max_batch_size) if self._stream is not None else None
        self._spec_index = {s.name: i for i, s in enumerate(model.io.outputs)}
        self._split = head_split(model.module)
        # Whether a separable model's output projection runs a chunk of positions at a time, and
        # the fp32 bytes of one chunk (outputs.OutputContext); benchmarks change them to compare.
        self.chunked = True
        self.chunk_bytes = CHUNK_BYTES
        self._token = token_input(model.io)
        mask = model.io.attention_mask
        self._mask = next((i for i, s in enumerate(model.io.inputs) if s.name == mask), None)
        self._running = 0

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
        """A batch is running on this instance's thread right now."""
        return self._running > 0

    def run(self, works: Sequence[Work]) -> BatchResult:
        """Run one batch (called on this instance's thread)."""
        self._running += 1
        try:
            return self._run(works)
        finally:
            self._running -= 1

    def _run(self, works: Sequence[Work]) -> BatchResult:
        start = time.perf_counter_ns()
        with torch.inference_mode():
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    host = self._execute(self._gather_cuda(works), works)
            else:
                host = self._execute(self._gather(works), works)
            per_request = [encode_named(named) for named in host]
        return BatchResult(per_request, time.perf_counter_ns() - start)

    def _execute(self, xs: list[torch.Tensor], works: Sequence[Work]) -> list[list[NamedTensor]]:
        """The forward pass and the transforms. A model with a separable output projection (an
        hf: causal LM) returns its final hidden states instead when every request wants that
        output reduced (top-k, scores): the transforms then apply the projection a chunk of
        positions at a time, and the full logits never exist."""
        split = self._split
        if split is not None and self.chunked and all(
                want.reduces(bool(w.aux)) for w in works for want in w.outputs if want.name == split.head_output):
            return self._transform(split.hidden(*xs), works, xs, split.head)
        return self._transform(self.model.forward(xs), works, xs, None)

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
        xs = []
        for i, buf in enumerate(self._staging):
            if buf is None or total > buf.shape[0]:
                host = batch_input(works, i).pin_memory()
            else:
                host = buf[:total]
                torch.cat([w.inputs[i] for w in works], out=host)
            xs.append(host.to(self.model.device, non_blocking=True))
        return xs

    def _transform(self, outs: list[torch.Tensor], works: Sequence[Work], xs: list[torch.Tensor],
                   head: Callable[[torch.Tensor], torch.Tensor] | None) -> list[list[NamedTensor]]:
        """Each request's transformed outputs as host tensors. The transforms run on the device
        the outputs live on; only their results are copied to the host. When every request of the
        batch wants the same transforms (the usual case), they run once on the whole batch and the
        host tensors are split after the one copy."""
        specs = self.model.io.outputs
        first = works[0].outputs
        if all(w.outputs == first and w.aux.keys() == works[0].aux.keys() for w in works[1:]):
            rows = self._row_context(xs, works, outs, first)
            whole = [
                (name, copy_to_host(t), specs[self._spec_index[want.name]])
                for want in first
                for name, t in self._apply(outs, want, rows, head)
            ]
            result: list[list[NamedTensor]] = []
            offset = 0
            for w in works:  # per-position outputs (and their top-k) cut back to each request's length
                result.append([(name, _cut(w, name, t[offset : offset + w.batch_size], spec))
                               for name, t, spec in whole])
                offset += w.batch_size
            return result
        result = []
        offset = 0
        for w in works:
            named: list[NamedTensor] = []
            cut = [w.cut(o[offset : offset + w.batch_size], s) for o, s in zip(outs, specs, strict=True)]
            rows = self._row_context([x[offset : offset + w.batch_size] for x in xs], [w], cut, w.outputs)
            for want in w.outputs:
                named.extend((name, copy_to_host(t)) for name, t in self._apply(cut, want, rows, head))
            result.append(named)
            offset += w.batch_size
        return result

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
        """Stop the thread; with wait=False, return at once and leave a running batch behind (a
        forward pass cannot be interrupted; its thread ends when the pass does)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)


def _cut(w: Work, name: str, t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A request's rows of a whole-batch output, cut back to its length (and its own number of
    score ids)."""
    t = w.cut(t, spec)
    scores = w.aux.get("SCORE_IDS")
    if scores is not None and name.endswith("_SCORED_LOGPROBS") and t.shape[-1] != scores.shape[-1]:
        t = t.narrow(-1, 0, scores.shape[-1])
    return t
