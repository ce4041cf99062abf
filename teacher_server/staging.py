"""The next batch's inputs, formed and copied to the device while the current batch runs.

Without it an instance runs its batches' steps one after another: pad and concatenate the
requests' inputs on the host, copy them to the GPU, forward pass, transforms, copy back, encode.
The GPU idles during the host steps. With a `Stager`, the batcher forms the next batch as soon as
the current one starts (`DynamicBatcher`, pipelined workers) and hands it to the stager's own
thread, which builds the batch's inputs in pinned host memory and copies them to the device on its
own CUDA stream, recording an event. The instance then finds them ready (`take_staged`): its
compute stream waits on that event (a GPU-side wait, no host sync) and the forward pass starts at
once.

On a CPU model there is nothing to copy and no stream to overlap with, so the server does not
stage at all (`wanted`): the pipeline is a CUDA feature. `Stager` on a CPU device still works (the
inputs are only built ahead, on the stager's thread), which is how the pipelined scheduling is
tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from teacher_server.threads import named_executor
from teacher_server.work import StagedInputs, Work, batch_input


def _key(works: Sequence[Work]) -> tuple[int, ...]:
    return tuple(id(w) for w in works)


def wanted(device: torch.device) -> bool:
    """Whether the server stages batches ahead on this device: only where copies can overlap compute."""
    return device.type == "cuda"


class Stager:
    """Builds batches' inputs on the device ahead of their execution, on one thread (and one CUDA
    stream) of its own; one per model instance."""

    def __init__(self, device: torch.device, index: int = 0) -> None:
        self.device = device
        self._executor = named_executor(f"stager-{index}")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged = 0  # batches staged so far (tests and logs read it)

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._executor

    def stage(self, works: Sequence[Work]) -> None:
        """Build `works`' batch inputs on the device and attach them to works[0] (called on this
        stager's thread). The copies are queued on the stager's stream and not waited for."""
        n_inputs = len(works[0].inputs)
        with torch.inference_mode():
            if self._stream is None:
                tensors = [batch_input(works, i) if len(works) > 1 else works[0].inputs[i] for i in range(n_inputs)]
                tensors = [t.to(self.device) for t in tensors]
                staged = StagedInputs(tensors, _key(works))
            else:
                with torch.cuda.stream(self._stream):
                    tensors = [batch_input(works, i, pin=True).to(self.device, non_blocking=True)
                               for i in range(n_inputs)]
                    event = torch.cuda.Event()
                    event.record(self._stream)
                staged = StagedInputs(tensors, _key(works), event, self._stream)
        works[0].staged = staged
        self.staged += 1

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)


def take_staged(works: Sequence[Work]) -> list[torch.Tensor] | None:
    """The batch's staged inputs, if a stager built them for exactly these works; else None (the
    instance gathers them itself). Called on the instance's thread, inside its stream: on CUDA
    that stream waits for the copies, and the tensors are marked as used by it so their memory is
    not reused before the forward pass is done."""
    staged = works[0].staged if works else None
    if staged is None or staged.key != _key(works):
        return None
    works[0].staged = None
    if staged.event is not None:
        current = torch.cuda.current_stream(staged.tensors[0].device)
        current.wait_event(staged.event)
        for t in staged.tensors:
            t.record_stream(current)
    return staged.tensors
