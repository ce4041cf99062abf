"""What ``distill top`` draws: a :class:`~discovery.view.MeshView` as text or as plain data.

Pure (no registry, no clock unless asked), so the view's layout is tested on its own. Tables size
their columns to the content and, on a narrow screen, give up their least useful columns and cut
long names in the middle before the throughput figures are touched. The autoscaler's records have
no fixed format: JSON objects are shown as ``key=value`` pairs, other text as is, binary values by
their size.
"""

from __future__ import annotations

import contextlib
import json
import math
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from discovery import keys
from discovery.view import MeshView, ServiceView

__all__ = ["age", "describe_value", "render", "view_as_dict"]

# Shown first, in this order, when the autoscaler's record is a JSON object.
_DECISION_KEYS = ("action", "current", "desired", "ready", "needed", "demand", "served", "capacity", "cause", "reason")
_TIME_KEYS = ("at", "time", "timestamp", "updated_at", "decided_at")


def _rate(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else "-"


def age(seconds: float) -> str:
    """A duration for a narrow column: ``4.2s``, ``3m07s``, ``2h05m``; ``-`` when unknown."""
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
    now = now if now is not None else time.time()
    for k in ordered:
        v = obj[k]
        if k == "last_scale" and isinstance(v, dict) and {"from", "to", "at"} <= v.keys():
            with contextlib.suppress(TypeError, ValueError):  # a foreign shape falls through to JSON
                parts.append(f'last_scale="{int(v["from"])} -> {int(v["to"])}, {age(now - float(v["at"]))} ago"')
                continue
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, str) and (" " in v or not v):
            v = json.dumps(v)
        elif not isinstance(v, (str, int)):
            v = json.dumps(v, separators=(",", ":"))
        parts.append(f"{k}={v}")
    stamp = next((obj[k] for k in _TIME_KEYS if isinstance(obj.get(k), (int, float))), None)
    if stamp is not None:
        parts.append(f"({age(now - float(stamp))} ago)")
    return " ".join(parts)


# Which teacher columns give way first on a narrow screen; SAMPLES/S, BUSY and CAPACITY/S never do.
_TEACHER_DROP = ("INSTANCE", "LOAD AGE", "FINGERPRINT", "UP", "MAXB", "DEVICE", "INFLIGHT", "QUEUE", "STATE")
_TEACHER_SHRINK = ("MODEL", "ENDPOINT")


def _render_service(view: ServiceView, now: float, max_rows: int, width: int | None = None) -> list[str]:
    loads = [t.load for t in view.teachers if t.load is not None]
    capacity = sum(ld.capacity_samples_per_s for ld in loads)
    served = sum(ld.samples_per_s for ld in loads)
    demand = sum(d.samples_per_s for d in view.students)
    stall = sum(d.wait_fraction for d in view.students) / len(view.students) if view.students else 0.0
    fingerprints = {t.record.fingerprint for t in view.teachers if t.record.fingerprint}
    differ = (f"; {len(fingerprints)} different fingerprints (replicas serve other weights: distill "
              "check-teachers)") if len(fingerprints) > 1 else ""
    lines = _fit(
        f"service {view.name}: {len(view.teachers)} teacher(s), serving {_rate(served)} samples/s of "
        f"{_rate(capacity) if capacity else '?'} measured capacity; {len(view.students)} student(s) consuming "
        f"{_rate(demand)} samples/s, mean stall {_pct(stall)}{differ}", width)
    if view.teachers:
        rows = []
        for t in view.teachers[:max_rows]:
            r, ld = t.record, t.load
            model = f"{r.model_name}:{r.model_version}" if r.model_version else r.model_name
            up = age(now - r.started_at) if r.started_at else "-"
            if ld is None:
                figures = ["-", "-", "-", "-", "-", "-"]
            else:
                seen = age(now - ld.updated_at) if ld.updated_at else "-"
                figures = [str(ld.queue_depth), str(ld.in_flight), _rate(ld.samples_per_s), _pct(ld.busy_fraction),
                           _rate(ld.capacity_samples_per_s) if ld.capacity_samples_per_s else "-", seen]
            state = "draining" if ld is not None and ld.draining else "serving"
            rows.append([r.endpoint, t.instance_id, r.device or "-", model, r.fingerprint or "-",
                         str(r.max_batch_size), *figures, up, state])
        lines += _table(["ENDPOINT", "INSTANCE", "DEVICE", "MODEL", "FINGERPRINT", "MAXB", "QUEUE", "INFLIGHT",
                         "SAMPLES/S", "BUSY", "CAPACITY/S", "LOAD AGE", "UP", "STATE"], rows, left=5, width=width,
                        drop=_TEACHER_DROP, shrink=_TEACHER_SHRINK)
        if len(view.teachers) > max_rows:
            lines.append(f"  ... and {len(view.teachers) - max_rows} more teacher(s)")
    else:
        lines.append("  no teachers registered")
    if view.students:
        busiest = sorted(view.students, key=lambda d: -d.samples_per_s)[:max_rows]
        busiest.sort(key=lambda d: d.student_id)
        routing = any(d.rows_routed for d in busiest)  # route_by: each row to one service, counted here
        rows = [[d.student_id, _rate(d.samples_per_s), _pct(d.wait_fraction), str(d.in_flight),
                 str(d.teachers_in_use), *([f"{d.rows_routed:,}", f"{d.tokens_routed:,}"] if routing else []),
                 age(now - d.updated_at) if d.updated_at else "-"] for d in busiest]
        lines += _table(["STUDENT", "SAMPLES/S", "STALL", "INFLIGHT", "TEACHERS",
                         *(["ROWS ROUTED", "TOKENS ROUTED"] if routing else []), "AGE"], rows, width=width,
                        drop=("AGE", "TOKENS ROUTED", "TEACHERS", "INFLIGHT", "ROWS ROUTED"), shrink=("STUDENT",))
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
