"""Where a device waits: the idle gaps on a torch.profiler Chrome trace's device timeline, and what
the host was doing during them.

    .venv/bin/python -m benchmarks.trace_gaps TRACE.json[.gz] [--min-gap-ms 1] [--top 8]

W6 on an H100 left the device idle 40-60 ms a batch (`benchmarks/instance_pipeline.py` records
the traces). A GPU lease is minutes long and its files may not all come back, so the trace is
read where it was written: the device's busy intervals (kernels, copies, memsets) are merged,
every gap of at least `--min-gap-ms` between them is kept, and the host's events that overlap a gap
are summed by name: the CUDA runtime calls (a synchronisation, an allocation, a host-memory pin, a
copy that waits) and the operators the host was inside of. A gap spent in `cudaStreamSynchronize`
names a sync, one in `cudaMalloc`/`cudaFree` the caching allocator growing or giving memory back,
one in no CUDA call at all plain host work.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})
OP_CATS = frozenset({"cpu_op", "user_annotation"})


@dataclass(frozen=True)
class Gap:
    start_us: float
    dur_us: float


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The trace's complete events (`"ph": "X"`), from a .json or .json.gz file."""
    p = Path(path)
    with (gzip.open(p, "rt") if p.suffix == ".gz" else p.open()) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def device_intervals(events: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """The device's busy time, merged into disjoint, sorted [start, end) intervals (microseconds)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in DEVICE_CATS)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gaps(intervals: Sequence[tuple[float, float]], min_gap_us: float) -> list[Gap]:
    """The idle stretches between busy intervals of at least `min_gap_us`."""
    return [Gap(a_end, b_start - a_end) for (_, a_end), (b_start, _) in itertools.pairwise(intervals)
            if b_start - a_end >= min_gap_us]


def _overlap_by_name(events: Iterable[Mapping[str, Any]], cats: frozenset[str],
                     found: Sequence[Gap]) -> dict[str, float]:
    """Microseconds of the gaps that events of `cats` overlap, summed by the events' names."""
    if not found:
        return {}
    ends = [g.start_us + g.dur_us for g in found]
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") not in cats:
            continue
        s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        # The gaps are sorted and disjoint: walk from the first that ends after the event starts.
        lo = bisect.bisect_right(ends, s)
        for g in found[lo:]:
            if g.start_us >= t:
                break
            out[str(e.get("name", "?"))] += min(t, g.start_us + g.dur_us) - max(s, g.start_us)
    return dict(out)


def summarize(events: Sequence[Mapping[str, Any]], min_gap_us: float = 1000.0, top: int = 8) -> dict[str, Any]:
    """The device's busy and idle time over the traced span and, for the gaps of at least
    `min_gap_us`, the host's CUDA calls and operators during them (largest first)."""
    busy = device_intervals(events)
    if not busy:
        return {"device_events": 0, "note": "no device activity in the trace (a CPU run, or CUDA not profiled)"}
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    found = gaps(busy, min_gap_us)

    def ranked(d: Mapping[str, float]) -> list[list[object]]:
        return [[name, round(us / 1e3, 3)] for name, us in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {
        "device_events": sum(1 for e in events if e.get("cat") in DEVICE_CATS),
        "span_ms": round(span / 1e3, 3), "busy_ms": round(busy_us / 1e3, 3),
        "busy_fraction": round(busy_us / span, 3) if span > 0 else 1.0,
        "min_gap_ms": min_gap_us / 1e3, "gaps": len(found),
        "idle_in_gaps_ms": round(sum(g.dur_us for g in found) / 1e3, 3),
        "largest_gaps_ms": sorted((round(g.dur_us / 1e3, 3) for g in found), reverse=True)[:top],
        "cuda_calls_in_gaps_ms": ranked(_overlap_by_name(events, RUNTIME_CATS, found)),
        "ops_in_gaps_ms": ranked(_overlap_by_name(events, OP_CATS, found)),
    }


def report(path: str, s: Mapping[str, Any]) -> str:
    if not s.get("device_events"):
        return f"{path}: {s.get('note', 'no device activity')}"
    lines = [f"{path}: device busy {s['busy_ms']:.1f} of {s['span_ms']:.1f} ms ({s['busy_fraction']:.3f}); "
             f"{s['gaps']} gaps of >= {s['min_gap_ms']} ms, {s['idle_in_gaps_ms']:.1f} ms idle in them; "
             f"largest {s['largest_gaps_ms']}"]
    for title, key in (("CUDA calls during the gaps", "cuda_calls_in_gaps_ms"),
                       ("operators during the gaps", "ops_in_gaps_ms")):
        lines.append(f"  {title}: " + (", ".join(f"{n} {ms} ms" for n, ms in s[key]) or "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces from torch.profiler (.json or .json.gz)")
    p.add_argument("--min-gap-ms", type=float, default=1.0, help="shorter idle stretches are not counted as gaps")
    p.add_argument("--top", type=int, default=8, help="names listed per kind")
    a = p.parse_args(argv)
    if a.min_gap_ms < 0 or a.top < 1:
        p.error("--min-gap-ms must be >= 0 and --top >= 1")
    for path in a.traces:
        print(report(path, summarize(load_trace(path), a.min_gap_ms * 1e3, a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
