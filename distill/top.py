"""``distill top``: a live view of the mesh, read from etcd, refreshing like ``top``.

    distill top --registry etcd://10.0.0.5:2379                   # every service, refreshed every second
    distill top --registry etcd://10.0.0.5:2379 --service cv-teacher --once   # one snapshot, for scripts

What it shows, per service found under ``/distill/v1/``: the teachers (endpoint, device, model and
their latest published load: queue, in-flight, samples/s, busy %, measured capacity), the students
(samples/s consumed, stall %, in-flight chunks, teachers in use) and whatever the autoscaler keeps
under its prefix (the leader, and its last decision when it publishes one).

Why one range read of the whole ``/distill/v1/`` prefix per refresh rather than the registry's
per-service reads: one request gives a consistent snapshot (one etcd revision) of every service,
and it discovers the services at the same time. The values are the registry's protobuf messages;
a value that does not parse is counted and skipped, never fatal (top is what you run when things
look wrong). The autoscaler's records have no fixed format here: JSON objects are shown as
``key=value`` pairs, other text as is, binary values by their size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError, Message

from discovery import keys
from discovery.address import parse_address
from discovery.aio import bounded, deadline, raise_if_cancel_lost
from discovery.base import RegistryError, RegistryUnavailableError
from discovery.etcd import EtcdRegistry
from discovery.options import add_registry_security_args, registry_security_options
from protos import registry_pb2

__all__ = [
    "AutoscalerRecord",
    "MeshView",
    "ServiceView",
    "TeacherRow",
    "add_arguments",
    "describe_value",
    "parse_kvs",
    "read_view",
    "render",
    "run",
    "view_as_dict",
]

# Shown first, in this order, when the autoscaler's record is a JSON object.
_DECISION_KEYS = ("action", "current", "desired", "ready", "needed", "demand", "served", "capacity", "cause", "reason")
_TIME_KEYS = ("at", "time", "timestamp", "updated_at", "decided_at")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home + clear screen: enough for a refreshing view, no curses needed


@dataclass(frozen=True)
class TeacherRow:
    """One registered teacher and its latest load (None until it publishes one)."""

    instance_id: str
    record: registry_pb2.TeacherRecord
    load: registry_pb2.TeacherLoad | None = None


@dataclass(frozen=True)
class AutoscalerRecord:
    """One key under the service's autoscaler prefix: its name below the prefix and its raw value."""

    name: str
    value: bytes


@dataclass
class ServiceView:
    """Everything the registry holds for one service, at one revision."""

    name: str
    teachers: list[TeacherRow] = field(default_factory=list)
    students: list[registry_pb2.StudentDemand] = field(default_factory=list)
    autoscaler: list[AutoscalerRecord] = field(default_factory=list)
    unparsable: int = 0  # values under the service that did not parse (skipped)


@dataclass
class MeshView:
    """One snapshot of the registry: every service (sorted by name) and when it was read."""

    registry: str
    revision: int
    taken_at: float
    services: list[ServiceView] = field(default_factory=list)


def _parse(cls: type[Message], value: bytes) -> Any | None:
    msg = cls()
    try:
        msg.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError):
        return None
    return msg


def parse_kvs(kvs: Iterable[tuple[bytes, bytes]], only: Sequence[str] = ()) -> list[ServiceView]:
    """Group ``(key, value)`` pairs under ``/distill/v1/`` into services (optionally only ``only``).

    Pure (no etcd), so the view's logic is testable on its own. Keys of unknown kinds are ignored;
    a teacher's load joins its record by instance id; a load without a record is dropped (the
    teacher is going away: records and loads share a lease, the record is deleted first).
    """
    root = f"{keys.ROOT}/"
    services: dict[str, ServiceView] = {}
    loads: dict[str, dict[str, registry_pb2.TeacherLoad]] = {}
    records: dict[str, dict[str, registry_pb2.TeacherRecord]] = {}
    for raw_key, value in kvs:
        key = raw_key.decode("utf-8", "replace")
        if not key.startswith(root):
            continue
        service, _, rest = key[len(root) :].partition("/")
        if not service or not rest or (only and service not in only):
            continue
        view = services.setdefault(service, ServiceView(service))
        kind, _, name = rest.partition("/")
        if kind == "autoscaler":
            view.autoscaler.append(AutoscalerRecord(name, value))
            continue
        if not name or "/" in name:
            continue
        if kind == "teachers":
            rec = _parse(registry_pb2.TeacherRecord, value)
            if rec is None or not rec.endpoint:
                view.unparsable += 1
            else:
                records.setdefault(service, {})[name] = rec
        elif kind == "load":
            load = _parse(registry_pb2.TeacherLoad, value)
            if load is None:
                view.unparsable += 1
            else:
                loads.setdefault(service, {})[name] = load
        elif kind == "students":
            demand = _parse(registry_pb2.StudentDemand, value)
            if demand is None:
                view.unparsable += 1
            else:
                if not demand.student_id:
                    demand.student_id = name
                view.students.append(demand)
    for service, recs in records.items():
        view = services[service]
        view.teachers = [TeacherRow(iid, rec, loads.get(service, {}).get(iid)) for iid, rec in recs.items()]
        view.teachers.sort(key=lambda t: (t.record.endpoint, t.instance_id))
    for view in services.values():
        view.students.sort(key=lambda d: d.student_id)
        view.autoscaler.sort(key=lambda a: a.name)
    return [services[s] for s in sorted(services)]


async def read_view(registries: Sequence[EtcdRegistry], services: Sequence[str] = (),
                    timeout: float = 3.0) -> MeshView:
    """One consistent read of ``/distill/v1/``; tries each endpoint's registry in turn.

    Raises ``RegistryUnavailableError`` naming every endpoint and what went wrong with it.
    """
    errors: list[str] = []
    for registry in registries:
        client = registry.client()

        async def read(c: Any = client) -> Any:
            await c.connect()
            return await c.get_prefix(f"{keys.ROOT}/".encode())

        try:
            # deadline (asyncio.timeout), not wait_for: on Python 3.11 wait_for can swallow the
            # cancellation that Ctrl-C sends (asyncio.run cancels the main task).
            async with deadline(timeout):
                resp = await read()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure of this endpoint: try the next one
            detail = getattr(e, "details", None)
            text = detail() if callable(detail) else str(e) or type(e).__name__
            if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                text = f"no answer within {timeout:g} s"
            errors.append(f"{client.endpoint}: {text}")
            continue
        kvs = [(kv.key, kv.value) for kv in resp.kvs]
        return MeshView(registry=_address(registries), revision=int(resp.header.revision), taken_at=time.time(),
                        services=parse_kvs(kvs, services))
    raise RegistryUnavailableError(f"cannot read the registry at {_address(registries)} ({'; '.join(errors)})")


def _address(registries: Sequence[EtcdRegistry]) -> str:
    return "etcd://" + ",".join(str(ep) for r in registries for ep in r.endpoints)


# ---- rendering -------------------------------------------------------------------------------------


def _rate(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else "-"


def _age(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


_NAME_FLOOR = 16  # a name cut to fewer characters than this says little; drop other columns first


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, indent: str = "  ", *,
           width: int | None = None, drop: Sequence[str] = (), shrink: Sequence[str] = ()) -> list[str]:
    """Columns sized to their content; the first ``left`` left-aligned (names), the rest right-aligned (figures).

    With ``width``, a table wider than that is made to fit rather than clipped at the right edge,
    where the figures people look at live: first the columns named in ``drop`` go, in that order,
    then the name columns in ``shrink`` are cut in the middle, the widest first (``10.0~:9898``:
    both ends of an endpoint or a model name tell more than its start alone). Only a screen too narrow even for
    that is clipped.
    """
    cols = list(range(len(header)))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def total(keep: Sequence[int]) -> int:
        return len(indent) + sum(widths[i] for i in keep) + 2 * (len(keep) - 1)

    if width is not None:
        names = [list(header).index(n) for n in shrink if n in header]
        full = list(widths)
        for i in names:  # drop columns only while the table does not fit even with the names cut short
            widths[i] = min(full[i], max(_NAME_FLOOR, len(header[i])))
        for name in drop:
            if total(cols) <= width:
                break
            if name in header:
                cols.remove(list(header).index(name))
        for i in names:
            widths[i] = full[i]
        names = [i for i in names if i in cols]
        for floor in (_NAME_FLOOR, 6):  # take from the widest name column first, one character at a time
            while total(cols) > width:
                room = [i for i in names if widths[i] > max(floor, len(header[i]))]
                if not room:
                    break
                widths[max(room, key=lambda i: widths[i])] -= 1

    def cell(text: str, i: int) -> str:
        w = widths[i]
        if len(text) > w:
            head = (w - 1) // 2
            text = text[:head] + "~" + text[len(text) - (w - 1 - head):]
        return text.ljust(w) if i < left else text.rjust(w)

    def line(cells: Sequence[str]) -> str:
        text = (indent + "  ".join(cell(cells[i], i) for i in cols)).rstrip()
        return text if width is None else text[:width]

    return [line(header), *(line(r) for r in rows)]


def _fit(text: str, width: int | None, indent: str = "  ") -> list[str]:
    """One line of prose, wrapped at ``width`` (continuations indented) rather than clipped."""
    if width is None or len(text) <= width:
        return [text]
    lead = text[: len(text) - len(text.lstrip())] + indent
    return textwrap.wrap(text, width, subsequent_indent=lead, break_long_words=True, break_on_hyphens=False)


def describe_value(value: bytes, now: float | None = None) -> str:
    """An autoscaler record for humans, whatever its format (see the module docstring)."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return f"<{len(value)} bytes of binary data>"
    try:
        obj = json.loads(text)
    except ValueError:
        flat = " ".join(text.split())
        return flat if len(flat) <= 160 else flat[:157] + "..."
    if not isinstance(obj, dict):
        return json.dumps(obj)
    ordered = [k for k in _DECISION_KEYS if k in obj] + [k for k in obj if k not in _DECISION_KEYS + _TIME_KEYS]
    parts = []
    for k in ordered:
        v = obj[k]
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, str) and (" " in v or not v):
            v = json.dumps(v)
        elif not isinstance(v, (str, int)):
            v = json.dumps(v, separators=(",", ":"))
        parts.append(f"{k}={v}")
    stamp = next((obj[k] for k in _TIME_KEYS if isinstance(obj.get(k), (int, float))), None)
    if stamp is not None:
        parts.append(f"({_age((now if now is not None else time.time()) - float(stamp))} ago)")
    return " ".join(parts)


# Which teacher columns give way first on a narrow screen; SAMPLES/S, BUSY and CAPACITY/S never do.
_TEACHER_DROP = ("INSTANCE", "LOAD AGE", "UP", "MAXB", "DEVICE", "INFLIGHT", "QUEUE", "STATE")
_TEACHER_SHRINK = ("MODEL", "ENDPOINT")


def _render_service(view: ServiceView, now: float, max_rows: int, width: int | None = None) -> list[str]:
    loads = [t.load for t in view.teachers if t.load is not None]
    capacity = sum(ld.capacity_samples_per_s for ld in loads)
    served = sum(ld.samples_per_s for ld in loads)
    demand = sum(d.samples_per_s for d in view.students)
    stall = sum(d.wait_fraction for d in view.students) / len(view.students) if view.students else 0.0
    lines = _fit(
        f"service {view.name}: {len(view.teachers)} teacher(s), serving {_rate(served)} samples/s of "
        f"{_rate(capacity) if capacity else '?'} measured capacity; {len(view.students)} student(s) consuming "
        f"{_rate(demand)} samples/s, mean stall {_pct(stall)}", width)
    if view.teachers:
        rows = []
        for t in view.teachers[:max_rows]:
            r, ld = t.record, t.load
            model = f"{r.model_name}:{r.model_version}" if r.model_version else r.model_name
            up = _age(now - r.started_at) if r.started_at else "-"
            if ld is None:
                figures = ["-", "-", "-", "-", "-", "-"]
            else:
                seen = _age(now - ld.updated_at) if ld.updated_at else "-"
                figures = [str(ld.queue_depth), str(ld.in_flight), _rate(ld.samples_per_s), _pct(ld.busy_fraction),
                           _rate(ld.capacity_samples_per_s) if ld.capacity_samples_per_s else "-", seen]
            state = "draining" if ld is not None and ld.draining else "serving"
            rows.append([r.endpoint, t.instance_id, r.device or "-", model, str(r.max_batch_size), *figures, up,
                         state])
        lines += _table(["ENDPOINT", "INSTANCE", "DEVICE", "MODEL", "MAXB", "QUEUE", "INFLIGHT", "SAMPLES/S",
                         "BUSY", "CAPACITY/S", "LOAD AGE", "UP", "STATE"], rows, left=4, width=width,
                        drop=_TEACHER_DROP, shrink=_TEACHER_SHRINK)
        if len(view.teachers) > max_rows:
            lines.append(f"  ... and {len(view.teachers) - max_rows} more teacher(s)")
    else:
        lines.append("  no teachers registered")
    if view.students:
        busiest = sorted(view.students, key=lambda d: -d.samples_per_s)[:max_rows]
        busiest.sort(key=lambda d: d.student_id)
        rows = [[d.student_id, _rate(d.samples_per_s), _pct(d.wait_fraction), str(d.in_flight),
                 str(d.teachers_in_use), _age(now - d.updated_at) if d.updated_at else "-"] for d in busiest]
        lines += _table(["STUDENT", "SAMPLES/S", "STALL", "INFLIGHT", "TEACHERS", "AGE"], rows, width=width,
                        drop=("AGE", "TEACHERS", "INFLIGHT"), shrink=("STUDENT",))
        if len(view.students) > max_rows:
            lines.append(f"  ... and {len(view.students) - max_rows} more student(s) (showing the busiest)")
    else:
        lines.append("  no students publishing demand")
    if view.autoscaler:
        for rec in view.autoscaler:
            lines += _fit(f"  autoscaler {rec.name or '(prefix)'}: {describe_value(rec.value, now)}", width)
    else:
        lines.append("  autoscaler: none running")
    if view.unparsable:
        lines.append(f"  ({view.unparsable} value(s) under this service did not parse and were skipped)")
    return lines


def render(view: MeshView, *, max_rows: int = 50, services: Sequence[str] = (), now: float | None = None,
           width: int | None = None) -> str:
    """The whole screen as text (pure; ``now`` defaults to the time the view was taken).

    ``width``: the screen's columns; every line then fits in it, tables giving up their less useful
    columns and cutting long names before the throughput figures are touched (None: no limit).
    """
    t = view.taken_at if now is None else now
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view.taken_at))
    lines = [*_fit(f"distill top - {view.registry} - {stamp} - revision {view.revision} - "
                   f"{len(view.services)} service(s)", width), ""]
    if not view.services:
        wanted = f" named {', '.join(services)}" if services else ""
        lines += _fit(f"no services{wanted} under {keys.ROOT}/ yet (teachers register there when they start "
                      "with --registry and --service)", width)
    for s in view.services:
        lines += _render_service(s, t, max_rows, width)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def view_as_dict(view: MeshView) -> dict[str, Any]:
    """The snapshot as plain data (``--json``): protobuf messages become dicts with their field names."""

    def msg(m: Message | None) -> dict[str, Any] | None:
        return None if m is None else MessageToDict(m, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True)

    return {
        "registry": view.registry,
        "revision": view.revision,
        "taken_at": view.taken_at,
        "services": [
            {
                "name": s.name,
                "teachers": [{"instance_id": t.instance_id, "record": msg(t.record), "load": msg(t.load)}
                             for t in s.teachers],
                "students": [msg(d) for d in s.students],
                "autoscaler": {a.name: a.value.decode("utf-8", "replace") for a in s.autoscaler},
                "unparsable": s.unparsable,
            }
            for s in view.services
        ],
    }


# ---- command line ----------------------------------------------------------------------------------


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


def _registry_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"timeout": args.timeout, **registry_security_options(args)}


def _open(address: str, options: dict[str, Any]) -> list[EtcdRegistry]:
    """One registry per endpoint, so a dead endpoint is skipped on every refresh, not just once."""
    parsed = parse_address(address)
    if parsed.scheme != "etcd":
        raise ValueError(f"distill top reads etcd; {address!r} is a static teacher list with no load or demand")
    return [EtcdRegistry(ep, **options) for ep in parsed.endpoints]


_CLOSE_TIMEOUT_S = 5.0


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def _run(args: argparse.Namespace, out: Any) -> int:
    registries = _open(args.registry, _registry_options(args))
    # Its own handlers, like teacher-server's and the autoscaler's: Ctrl-C and SIGTERM end the view
    # with exit 0, also where the parent started it with SIGINT ignored (a script's background job).
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        main.cancel()

    handled = []
    for sig in _STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, stop)
            handled.append(sig)
    try:
        view = await read_view(registries, args.service, args.timeout)  # the first read decides: exit 1 if down
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
                        f"last snapshot, {_age(time.time() - view.taken_at)} old:\n{text}")
            clipped = "\n".join(line[:width] for line in text.splitlines())
            out.write(f"{_CLEAR}{clipped}\n(refreshing every {args.interval:g} s; Ctrl-C to quit)\n")
            out.flush()
            await asyncio.sleep(args.interval)
            try:
                view, problem = await read_view(registries, args.service, args.timeout), None
            except RegistryUnavailableError as e:
                problem = str(e)
            raise_if_cancel_lost()  # a Ctrl-C that met the read's answer, which gRPC then returned
    except asyncio.CancelledError:
        if not stopped:
            raise
        return 0
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        # Bounded: Ctrl-C lands here, and a close stuck on a dying connection must not eat it.
        for r in registries:
            with contextlib.suppress(TimeoutError):
                await bounded(r.close(), _CLOSE_TIMEOUT_S)


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
        print(f"distill top: {e}. Is etcd running there, and is the address right?", file=sys.stderr)
        return 1
    except ValueError as e:  # a bad address or option, an unreadable certificate file
        print(f"distill top: {e}", file=sys.stderr)
        return 2
