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

__all__ = ["PROCESS_DEFAULTS", "apply_process_defaults", "main"]

PROCESS_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment defaults of a teacher-server process, applied unless the variable (or, for the
wait policy, `GOMP_SPINCOUNT`) is set."""

_OVERRIDDEN_BY = {"OMP_WAIT_POLICY": ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def apply_process_defaults(environ: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, str]:
    """Set each of `PROCESS_DEFAULTS` the environment leaves unset; what was set. Call it before
    anything imports torch."""
    applied = {}
    for name, value in PROCESS_DEFAULTS.items():
        if not any(other in environ for other in _OVERRIDDEN_BY.get(name, (name,))):
            environ[name] = value
            applied[name] = value
    return applied


def main(argv: Sequence[str] | None = None) -> int:
    apply_process_defaults()
    from teacher_server.cli import main as cli_main  # imports torch

    return cli_main(argv)
