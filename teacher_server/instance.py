"""A model instance: one thread (and one CUDA stream on GPU) that executes whole batches.

Everything heavy happens here, off the event loop: concatenating the requests' inputs, the
host-to-device copy, the forward pass, the output transforms (on the model's device, so only the
reduced tensors are copied back), the device-to-host copy, and splitting + encoding each request's
outputs. torch releases the GIL inside its kernels, so N instances overlap their compute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from teacher_server.model import LoadedModel
from teacher_server.outputs import EncodedOutput, NamedTensor, encode_named, transform_output
from teacher_server.staging import take_staged
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
                    outs = self.model.forward(self._gather_cuda(works))
                    host = self._transform(outs, works)
            else:
                host = self._transform(self.model.forward(self._gather(works)), works)
            per_request = [encode_named(named) for named in host]
        return BatchResult(per_request, time.perf_counter_ns() - start)

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

    def _transform(self, outs: list[torch.Tensor], works: Sequence[Work]) -> list[list[NamedTensor]]:
        """Each request's transformed outputs as host tensors. The transforms run on the device
        the outputs live on; only their results are copied to the host. When every request of the
        batch wants the same transforms (the usual case), they run once on the whole batch and the
        host tensors are split after the one copy."""
        specs = self.model.io.outputs
        first = works[0].outputs
        if all(w.outputs == first for w in works[1:]):
            whole = [
                (name, copy_to_host(t), specs[self._spec_index[want.name]])
                for want in first
                for name, t in transform_output(outs[self._spec_index[want.name]],
                                                specs[self._spec_index[want.name]], want)
            ]
            result: list[list[NamedTensor]] = []
            offset = 0
            for w in works:  # per-position outputs (and their top-k) cut back to each request's length
                result.append([(name, w.cut(t[offset : offset + w.batch_size], spec)) for name, t, spec in whole])
                offset += w.batch_size
            return result
        result = []
        offset = 0
        for w in works:
            named: list[NamedTensor] = []
            for want in w.outputs:
                i = self._spec_index[want.name]
                part = w.cut(outs[i][offset : offset + w.batch_size], specs[i])
                named.extend((name, copy_to_host(t)) for name, t in transform_output(part, specs[i], want))
            result.append(named)
            offset += w.batch_size
        return result

    def close(self, wait: bool = True) -> None:
        """Stop the thread; with wait=False, return at once and leave a running batch behind (a
        forward pass cannot be interrupted; its thread ends when the pass does)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
