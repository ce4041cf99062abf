"""Models served by teacher-server subprocesses in the fault suite (``tests.faults.models:<factory>``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from tests.models import Affine

SLEEP_FILE_ENV = "FAULT_SLEEP_FILE"


class FlagSleepy(Affine):
    """Affine plus a per-batch sleep whose length (ms) is re-read from a file on every batch.

    Why a file: the test must change a running subprocess's latency without restarting it (a
    restart would be a different fault). The path comes from ``$FAULT_SLEEP_FILE``; a missing or
    unreadable file means 0 ms, so a half-written flip never crashes the teacher.
    """

    def __init__(self) -> None:
        super().__init__()
        path = os.environ.get(SLEEP_FILE_ENV)
        self.path = Path(path) if path else None

    def sleep_s(self) -> float:
        if self.path is None:
            return 0.0
        try:
            return max(0.0, float(self.path.read_text().strip() or 0)) / 1000
        except (OSError, ValueError):
            return 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s())  # releases the GIL, like an accelerator kernel
        return super().forward(x)


def flag_sleepy() -> FlagSleepy:
    return FlagSleepy()


def set_sleep_ms(path: Path, ms: float) -> None:
    """Flip a FlagSleepy teacher's latency atomically (write then rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{ms}")
    tmp.replace(path)
