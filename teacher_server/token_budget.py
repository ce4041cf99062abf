"""A padded model's default token budget on a GPU, from the model's shape and the device's memory.

The default budget (`BatchingConfig.token_budget`: max_batch_size x 64 positions, 16,384 at the
defaults) is a number of positions, not of bytes: a 7B teacher in bf16 on a 24 GB card has about 8
GB left beside its weights, and each of its instances computes a batch at a time. So when the budget
is left at its default, a `hf:` transformer on CUDA gets it capped to what its instances' batches
can hold in the free memory:

    positions <= (HEADROOM x free - instances x CHUNKS x chunk bytes) / (instances x bytes a position)

with bytes a position estimated from the model's shape, `ACTIVATION_MARGIN` x element size x (3 x
intermediate + 6 x hidden): a forward pass without a KV cache keeps one layer's activations at a
time, and the output projection runs a chunk of positions at a time (`outputs.CHUNK_BYTES`), so its
logits never exist whole. The estimate is checked against what `benchmarks.teacher_memory` measured
on a GPU (`tests/test_token_budget.py`). A budget set with --max-batch-tokens is the user's and is
never changed; nor are models whose shape is unknown, or CPU models (host memory is not the limit
there: the cores are).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from teacher_server.batch_rules import BatchingConfig
from teacher_server.model import LoadedModel

log = logging.getLogger(__name__)

HEADROOM = 0.8  # of the free memory, the rest left to the allocator's fragmentation and other processes
ACTIVATION_MARGIN = 1.5  # over the shape's estimate: temporaries the estimate does not name
CHUNKS = 3  # chunk-sized buffers the output transforms may hold at once: fp32 logits and log-probs, one more of margin
GRAIN = 64  # the budget is rounded down to a multiple of this many positions
MIN_BUDGET = 256


def bytes_per_position(module: Any) -> int | None:
    """The estimated activation bytes one position costs in a forward pass of a transformers
    model (`HFTeacher`'s `.model`, or the model itself); None when its shape is unknown."""
    model = getattr(module, "model", module)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    intermediate = getattr(config, "intermediate_size", None) or (4 * hidden if isinstance(hidden, int) else None)
    if not isinstance(hidden, int) or not isinstance(intermediate, int) or not isinstance(model, torch.nn.Module):
        return None
    param = next(model.parameters(), None)
    element = param.element_size() if param is not None else 4
    return int(ACTIVATION_MARGIN * element * (3 * intermediate + 6 * hidden))


def fitting_budget(per_position: int, free_bytes: int, instances: int, chunk_bytes: int) -> int:
    """The most positions a batch may have so that `instances` batches at once fit in HEADROOM of
    `free_bytes` (rounded down to GRAIN, at least MIN_BUDGET)."""
    room = HEADROOM * free_bytes - instances * CHUNKS * chunk_bytes
    positions = int(room // (max(1, instances) * max(1, per_position)))
    return max(MIN_BUDGET, positions // GRAIN * GRAIN)


def fit_to_memory(model: LoadedModel, batching: BatchingConfig, instances: int, chunk_bytes: int) -> BatchingConfig:
    """`batching` with its default token budget capped to the device's free memory (see the module's
    doc); unchanged off CUDA, for an explicit --max-batch-tokens, or a model without padded inputs
    or of unknown shape."""
    padded = any(s.pad_value is not None for s in model.io.inputs)
    if model.device.type != "cuda" or batching.max_batch_tokens or not padded:
        return batching
    per_position = bytes_per_position(model.module)
    if per_position is None:
        return batching
    try:
        free, _total = torch.cuda.mem_get_info(model.device)
    except RuntimeError as e:  # a driver that cannot say: keep the default
        log.warning("cannot read %s's free memory (%s); the token budget stays %d", model.device, e,
                    batching.token_budget)
        return batching
    fitting = fitting_budget(per_position, free, instances, chunk_bytes)
    if fitting >= batching.token_budget:
        return batching
    log.warning("token budget %d positions a batch capped to %d: %d instance(s) on %s with %.1f GiB free, about %d "
                "KB a position (set --max-batch-tokens to choose it yourself)", batching.token_budget, fitting,
                instances, model.device, free / 2**30, per_position // 1000)
    return dataclasses.replace(batching, max_batch_tokens=fitting)
