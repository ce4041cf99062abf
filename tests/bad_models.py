"""Teacher models that misbehave on purpose, importable by teacher-server as tests.bad_models:<factory>.

`poison`: the Affine model, except that it raises on any batch holding a row whose first feature is
POISON (a bad sample that makes the real model crash). `wrong_shape`: declares Affine's Y:FP32:4 but
answers [N, 2] once past the server's zero-input warm-up check (a teacher whose metadata lies
about its outputs).
"""

from __future__ import annotations

import torch

from tests.models import Affine

POISON = 12345.0


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
