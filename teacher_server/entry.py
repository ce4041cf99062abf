"""The `teacher-server` process's entry point (the console script and `python -m teacher_server`).

Some process settings only take effect before torch is imported: the OpenMP runtime bundled with
torch's CPU build reads its wait policy once, when it loads. By default each intra-op worker thread
spins for a while after every parallel region, waiting for the next one; a teacher's model runs a
few small regions per batch and then waits for the next request, so those spins take the cores the
event loop, gRPC's threads and every other process on the host need, for no work. So a teacher
process waits passively (`OMP_WAIT_POLICY=PASSIVE`: an idle worker sleeps at once) unless the
environment already sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`, which then rule.

`serve()` and `start()` run inside the caller's process, where torch is usually imported already:
set the variable in that process's environment before it starts (docs/guides/serving.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["WAIT_POLICY", "apply_process_defaults", "main"]

WAIT_POLICY = "PASSIVE"
"""The `OMP_WAIT_POLICY` of a teacher-server process whose environment sets neither it nor
`GOMP_SPINCOUNT` (either is a choice of how to wait)."""

_CHOSEN_BY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_process_defaults(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, str]:
    """Set the wait policy unless the environment chose one; what was set. Call it before anything
    imports torch."""
    if any(name in environ for name in _CHOSEN_BY):
        return {}
    environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def main(argv: Sequence[str] | None = None) -> int:
    apply_process_defaults()
    from teacher_server.cli import main as cli_main  # imports torch

    return cli_main(argv)
