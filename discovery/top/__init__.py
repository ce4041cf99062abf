"""``distill top``: a live view of the mesh, read from the registry, refreshing like ``top``.

    distill top --registry etcd://10.0.0.5:2379                   # every service, refreshed every second
    distill top --registry etcd://10.0.0.5:2379 --service cv-teacher --once   # one snapshot, for scripts

What it shows, per service: the teachers (endpoint, device, model, fingerprint, and their latest
published load: queue, in-flight, samples/s, busy %, measured capacity), the students (samples/s consumed, stall %,
in-flight chunks, teachers in use) and whatever the autoscaler keeps (the leader, and its last
decision when it publishes one).

Why it lives in ``discovery`` (the operator tools) and not in the training library: it reads
nothing but the registry, through :meth:`discovery.base.Registry.view` (one consistent read of
every service; etcd's is :mod:`discovery.etcd.view`), so it works with any backend that keeps
shared state and ``distill`` (the student side) does not carry it. ``distill top`` is still the
command: :mod:`distill.cli` mounts :func:`add_arguments` and :func:`run`. The drawing is
:mod:`discovery.top.render`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from discovery import open_registry
from discovery.address import parse_address
from discovery.aio import bounded, raise_if_cancel_lost
from discovery.backends import backend, shared_forms
from discovery.base import Registry
from discovery.errors import RegistryError, RegistryUnavailableError
from discovery.options import add_registry_security_args, registry_security_options
from discovery.signals import StopSignals
from discovery.top.render import age, describe_value, render, view_as_dict
from discovery.view import AutoscalerRecord, MeshView, ServiceView, TeacherRow

__all__ = [
    "AutoscalerRecord",
    "MeshView",
    "ServiceView",
    "TeacherRow",
    "add_arguments",
    "describe_value",
    "read_view",
    "render",
    "run",
    "view_as_dict",
]

_CLEAR = "\x1b[H\x1b[2J"  # cursor home + clear screen: enough for a refreshing view, no curses needed
_CLOSE_TIMEOUT_S = 5.0


async def read_view(registry: Registry, services: Sequence[str] = ()) -> MeshView:
    """One consistent read of the registry (every service, or only ``services``).

    Each call is bounded by the registry's own timeout (``--timeout``), and with several endpoints
    a dead one is skipped. Raises ``RegistryUnavailableError`` naming every endpoint and what went
    wrong with it.
    """
    return await registry.view(services)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``distill top`` (``distill.cli`` mounts them as a subcommand)."""
    p.add_argument("--registry", required=True, metavar="etcd://HOST:PORT[,HOST:PORT]",
                   help="the etcd the teachers and students register in")
    p.add_argument("--service", action="append", default=[], metavar="NAME",
                   help="show only this service (repeat for several; default: every service)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (for scripts and tests)")
    p.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    p.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                   help="fit the view in this many columns (default: the terminal's width when refreshing, "
                        "no limit with --once)")
    p.add_argument("--max-rows", type=int, default=50, help="teachers/students shown per service (default: 50)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for etcd per read (default: 3)")
    add_registry_security_args(p)
    return p


def _open(address: str, args: argparse.Namespace) -> Registry:
    """The registry to read; a backend without shared state (a static list) has nothing to show."""
    if not backend(parse_address(address).scheme).shared:
        raise ValueError(f"distill top reads etcd or another registry that keeps loads and demand "
                         f"({shared_forms()}); {address!r} is a static teacher list with no load or demand")
    return open_registry(address, timeout=args.timeout, **registry_security_options(args))


async def _run(args: argparse.Namespace, out: Any) -> int:
    registry = _open(args.registry, args)
    # Ctrl-C and SIGTERM end the view with exit 0, also where the parent started it with SIGINT
    # ignored (a script's background job): the signal cancels this task wherever it waits.
    main = asyncio.current_task()
    assert main is not None
    stop = StopSignals(cancel=main, required=False).install()
    try:
        view = await read_view(registry, args.service)  # the first read decides: exit 1 if down
        if args.once:
            if args.json:
                out.write(json.dumps(view_as_dict(view), indent=2) + "\n")
            else:
                out.write(render(view, max_rows=args.max_rows, services=args.service, width=args.width))
            out.flush()
            return 0
        problem: str | None = None
        while True:
            width = args.width or shutil.get_terminal_size((200, 50)).columns
            text = render(view, max_rows=args.max_rows, services=args.service, width=width)
            if problem is not None:  # keep the last view on screen and say how stale it is
                text = (f"registry unreachable, retrying every {args.interval:g} s: {problem}\n"
                        f"last snapshot, {age(time.time() - view.taken_at)} old:\n{text}")
            clipped = "\n".join(line[:width] for line in text.splitlines())
            out.write(f"{_CLEAR}{clipped}\n(refreshing every {args.interval:g} s; Ctrl-C to quit)\n")
            out.flush()
            await asyncio.sleep(args.interval)
            try:
                view, problem = await read_view(registry, args.service), None
            except RegistryUnavailableError as e:
                problem = str(e)
            raise_if_cancel_lost()  # a Ctrl-C that met the read's answer, which gRPC then returned
    except asyncio.CancelledError:
        if not stop.stopped:
            raise
        return 0
    finally:
        stop.uninstall()
        # Bounded: Ctrl-C lands here, and a close stuck on a dying connection must not eat it.
        with contextlib.suppress(TimeoutError):
            await bounded(registry.close(), _CLOSE_TIMEOUT_S)


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Run ``distill top`` with parsed flags; returns the exit code (1: registry unreachable)."""
    stream = out if out is not None else sys.stdout
    if not args.interval > 0:
        print("distill top: --interval must be > 0 seconds", file=sys.stderr)
        return 2
    if args.width is not None and args.width < 40:
        print("distill top: --width must be at least 40 columns", file=sys.stderr)
        return 2
    if args.json and not args.once:
        print("distill top: --json needs --once (a refreshing view is for people)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, stream))
    except KeyboardInterrupt:
        return 0
    except RegistryError as e:  # before OSError: RegistryUnavailableError is also a ConnectionError
        print(f"distill top: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a bad address or option, an unreadable certificate file
        print(f"distill top: {e}", file=sys.stderr)
        return 2
