"""Teacher models that misbehave on purpose, importable by teacher-server as tests.bad_models:<factory>.

`poison`: the Affine model, except that it raises on any batch holding a row whose first feature is
POISON (a bad sample that makes the real model crash). `wrong_shape`: declares Affine's Y:FP32:4 but
answers [N, 2] once past the server's zero-input warm-up check (a teacher whose metadata lies
about its outputs).

`overflow`: the Affine model, except that a row whose first feature is INF_MARK divides by zero
(inf) and one whose first feature is NAN_MARK computes 0/0 (NaN). `fp16_overflow`: a linear map
computed in fp16, which overflows to inf for a row of large features (FP16_BIG), as half-precision
teachers do. `overflow_lm`: the padded causal LM of `tests.seq_models`, whose logits are inf at every
position holding MARK_TOKEN and NaN at the positions its mask marks as padding (what some models
compute there: padding a batch adds such positions past a shorter row's end).
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.spec import ModelIO
from tests.models import Affine
from tests.seq_models import CausalConvLM

POISON = 12345.0
INF_MARK = 777.0
NAN_MARK = 999.0
FP16_BIG = 20000.0  # 8 features x 20000 x 0.5 = 80000, past fp16's largest finite 65504
MARK_TOKEN = 7


class Poison(Affine):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == POISON).any()):
            raise RuntimeError("poison marker in the input")
        return super().forward(x)


class WrongShape(Affine):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if not bool(x.any()):  # the server's load-time check runs zeros: pass it, lie afterwards
            return y
        return y[:, :2].contiguous()


def poison() -> Poison:
    return Poison()


def wrong_shape() -> WrongShape:
    return WrongShape()


class Overflow(Affine):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        first = x[:, :1]
        y = y / (first != INF_MARK).to(y.dtype)
        keep = (first != NAN_MARK).to(y.dtype)
        return y * keep / keep


class Fp16Overflow(nn.Module):
    io_spec = ModelIO.parse(["X:FP32:8"], ["Y:FP16:4"])

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8, 4), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half() @ self.w.half()


class OverflowLM(CausalConvLM):
    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(tokens, mask)
        logits = out["LOGITS"] / (tokens != MARK_TOKEN).unsqueeze(-1).to(torch.float32)
        logits = torch.where((mask == 0).unsqueeze(-1), torch.full_like(logits, float("nan")), logits)
        return {"LOGITS": logits, "POOLED": out["POOLED"]}


def overflow() -> Overflow:
    return Overflow()


def fp16_overflow() -> Fp16Overflow:
    return Fp16Overflow()


def overflow_lm() -> OverflowLM:
    return OverflowLM()
