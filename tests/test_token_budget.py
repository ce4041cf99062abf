"""The default token budget of a padded model on a GPU, capped to the device's free memory
(teacher_server.token_budget): the estimate from the model's shape against what an H200 measured,
the arithmetic of the cap, and that nothing changes off CUDA or for an explicit budget."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from teacher_server import token_budget
from teacher_server.batch_rules import BatchingConfig
from teacher_server.model import load_model
from teacher_server.outputs import CHUNK_BYTES
from teacher_server.token_budget import bytes_per_position, fit_to_memory, fitting_budget

GiB = 1 << 30


class _Shaped(torch.nn.Module):
    """A transformers-like model: a config with its shape and parameters in a dtype, no layers."""

    def __init__(self, hidden: int, intermediate: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate)
        self.w = torch.nn.Parameter(torch.zeros(2, dtype=dtype))


# What benchmarks/teacher_memory.py measured on an H200 for a Qwen2.5-1.5B shape in bf16: the bytes
# that chunked scoring of one sequence of that many tokens held above the loaded model.
H200_CHUNKED_SCORING_BYTES = {4096: 307_331_072, 8192: 580_059_136}


def test_the_estimate_covers_what_the_gpu_measured_for_a_qwen_1_5b_shape() -> None:
    est = bytes_per_position(SimpleNamespace(model=_Shaped(1536, 8960, torch.bfloat16)))
    assert est is not None
    measured = [held / seq for seq, held in H200_CHUNKED_SCORING_BYTES.items()]
    assert max(measured) <= est <= 2 * max(measured), (est, measured)


def test_the_estimate_follows_the_shape_and_the_dtype() -> None:
    bf16 = bytes_per_position(_Shaped(64, 256, torch.bfloat16))
    fp32 = bytes_per_position(_Shaped(64, 256, torch.float32))
    assert bf16 == int(1.5 * 2 * (3 * 256 + 6 * 64)) and fp32 == 2 * bf16
    assert bytes_per_position(_Shaped(64, None, torch.float32)) == bytes_per_position(_Shaped(64, 256, torch.float32))
    assert bytes_per_position(torch.nn.Linear(4, 4)) is None  # no config: unknown shape
    assert bytes_per_position(SimpleNamespace(model=object())) is None


def test_the_cap_fits_every_instances_batch_in_the_free_memory() -> None:
    per = 235_000  # about a 7B bf16 teacher's positions
    budget = fitting_budget(per, free_bytes=8 * GiB, instances=2, chunk_bytes=CHUNK_BYTES)
    assert budget % token_budget.GRAIN == 0
    used = 2 * (budget * per + token_budget.CHUNKS * CHUNK_BYTES)
    assert used <= token_budget.HEADROOM * 8 * GiB < used + 2 * token_budget.GRAIN * per
    assert fitting_budget(per, 16 * GiB, 1, CHUNK_BYTES) > 2 * budget  # one instance, twice the memory
    assert fitting_budget(per, 0, 2, CHUNK_BYTES) == token_budget.MIN_BUDGET  # never below the floor


def test_nothing_changes_off_cuda_or_when_the_budget_is_given() -> None:
    model = load_model("tests.seq_models:causal_conv_lm", device="cpu")
    assert any(s.pad_value is not None for s in model.io.inputs)
    default = BatchingConfig()
    assert fit_to_memory(model, default, 2, CHUNK_BYTES) is default
    given = BatchingConfig(max_batch_tokens=123_456)
    assert fit_to_memory(model, given, 2, CHUNK_BYTES) is given
