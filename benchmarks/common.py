"""Shared helpers for every benchmark: the machine, repetitions, statistics, results, signals.

The benchmark rules of docs/design/workloads.md are encoded here once so each workload cannot
drift from them:
ratios come from one run with the variants interleaved per repetition (`interleave`), the
headline is a median of at least five repetitions (`median`), every result file names the
machine it was measured on (`machine_info`) and lands in benchmarks/results/ (`write_results`;
``$DISTILL_BENCH_RESULTS`` points it elsewhere, e.g. for smoke runs that must not overwrite the
measured files).

The rest is split by job: `benchmarks.cpu` (who used the cores during a measurement, and a gate
that waits for a quiet machine), `benchmarks.procs` (process trees, children that report JSON
lines), `benchmarks.students` (the student subprocesses of W4 and the soak). Teacher servers are
started by `teacher_server.launch`, the launcher the examples and the autoscaler use too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(os.environ.get("DISTILL_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")

T = TypeVar("T")

# ---- the reference workloads' constants (docs/design/workloads.md), stated once for every benchmark
# Plain values, so that importing this module stays cheap (no torch);
# tests/test_benchmark_constants.py checks that they agree with the models and the server they describe.
EMULATED_MODEL_REF = "examples.emulated:build"  # W1, W4, the soak, the store: the emulated accelerator
EMULATED_MODEL_NAME = "emulated"
EMULATED_TEACHER_MS_ENV = "EMULATED_TEACHER_MS"  # examples.emulated reads its per-batch time from here
W1_BATCH = 256  # W1's batch: 256 x [3,32,32] fp32 in, [256,100] logits out
REF_MODEL_REF = "examples.refteacher:build"  # W2, W3: RefTeacher
REF_MODEL_NAME = "ref_teacher"
SERVER_QUEUE_DELAY_US = 500  # teacher-server's default --max-queue-delay-us
BATCHING_QUEUE_DELAY_US = 2000  # the serving benchmarks' batching server: a full batch of small requests


# ---- the machine ----------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (the platform module only knows the arch)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(torch_threads: int | None = None) -> dict[str, Any]:
    """What a reader needs to compare two result files: OS, interpreter, libraries, CPU, threads.

    Imports torch/grpc/numpy lazily so benchmarks that do not use them stay importable.
    """
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
    }
    for mod in ("torch", "grpc", "numpy"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except ImportError:
            info[f"{mod}_version"] = None
    if torch_threads is None:
        try:
            import torch

            torch_threads = torch.get_num_threads()
        except ImportError:
            pass
    info["torch_threads"] = torch_threads
    info["git"] = git_revision()
    return info


def git_revision() -> dict[str, Any]:
    """The commit measured and whether the tree had local changes: the code is part of the setup."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or None, "dirty_files": status.splitlines() if status else []}


# ---- repetitions and statistics -------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """Median, the workloads' headline statistic: robust to the odd repetition a neighbour spoiled."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN instead of ZeroDivisionError (a failed variant is still reported)."""
    return numerator / denominator if denominator else float("nan")


def sorted_groups(items: Sequence[T], budget: int, size: Callable[[T], int],
                  max_rows: int | None = None) -> list[list[T]]:
    """Length-sorted batches at a token budget: `items` sorted by `size` (stably) and cut into
    groups of as many as fit rows x the largest <= `budget` (an item larger than the budget on its
    own makes a group of one), at most `max_rows` a group. The in-process baselines' batching."""
    groups: list[list[T]] = []
    for item in sorted(items, key=size):
        group = groups[-1] if groups else []
        if not group or (len(group) + 1) * size(item) > budget or (max_rows is not None and len(group) >= max_rows):
            groups.append([item])
        else:
            group.append(item)
    return groups


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-repetition ratios of two interleaved variants.

    Pairing cancels slow drifts (thermal, a neighbour's job) that hit both variants of a
    repetition alike; their median is the headline ratio.
    """
    if len(numerators) != len(denominators):
        raise ValueError("paired ratios need the same number of repetitions on both sides")
    return [ratio(a, b) for a, b in zip(numerators, denominators, strict=True)]


def rate_fields(rates: Mapping[str, Sequence[float]], ratios: Sequence[float], ratio_key: str, goal: float,
                digits: int = 1) -> dict[str, Any]:
    """The results' entries of two interleaved variants: each one's rows/s per repetition and their
    median, the per-repetition ratios, the headline (their median) under `ratio_key`, the goal."""
    return {
        "rows_per_s": {v: [round(r, digits) for r in rs] for v, rs in rates.items()},
        "median_rows_per_s": {v: round(median(rs), digits) for v, rs in rates.items()},
        "ratios": [round(r, 3) for r in ratios],
        ratio_key: round(median(ratios), 3),
        "goal": f">= {goal}",
    }


def rate_report(doc: Mapping[str, Any], variants: tuple[str, str], ratio_key: str) -> str:
    """The table of `rate_fields` and its headline line, `A / B  ratio (per rep ...; goal ...)`."""
    med, rates = doc["median_rows_per_s"], doc["rows_per_s"]
    table = format_table(["variant", "median rows/s", "per rep"], [[v, med[v], str(rates[v])] for v in variants])
    return (f"{table}\n{variants[0]} / {variants[1]}  {doc[ratio_key]:.3f} (per rep {doc['ratios']}; goal "
            f"{doc['goal']})")


def interleave(
    reps: int,
    variants: Mapping[str, Callable[[], T]],
    on_result: Callable[[int, str, T], None] | None = None,
    *,
    before: Callable[[], object] | None = None,
    redo_if: Callable[[T], bool] | None = None,
    discarded: dict[str, list[T]] | None = None,
) -> dict[str, list[T]]:
    """Run every variant once per repetition, in the given order (A, B, A, B, ...).

    Running the variants back to back inside each repetition, instead of all A's then all B's,
    is what makes their ratio meaningful on a machine whose speed drifts during the run.
    `before`, `redo_if` and `discarded` work as in `ainterleave` (e.g. `QuietGate.wait_blocking`
    before every measurement, one redo of a measurement another process disturbed).
    """
    results: dict[str, list[T]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, fn in variants.items():
            if before is not None:
                before()
            value = fn()
            if redo_if is not None and redo_if(value):
                if discarded is not None:
                    discarded.setdefault(name, []).append(value)
                if before is not None:
                    before()
                value = fn()
            results[name].append(value)
            if on_result is not None:
                on_result(rep, name, value)
    return results


async def ainterleave(
    reps: int,
    variants: Mapping[str, Callable[[], Awaitable[T]]],
    on_result: Callable[[int, str, T], None] | None = None,
    *,
    before: Callable[[], Awaitable[object]] | None = None,
    redo_if: Callable[[T], bool] | None = None,
    discarded: dict[str, list[T]] | None = None,
) -> dict[str, list[T]]:
    """`interleave` for coroutine variants, with an optional quiet gate and one redo.

    `before` runs before every measurement (e.g. `QuietGate.wait`); a measurement for which
    `redo_if` is true (e.g. another process took a core meanwhile) is measured once more and
    the first attempt goes to `discarded`, so the JSON still shows what was thrown away. The
    same rule applies to every variant, so the gate cannot favour one side of a ratio.
    """
    results: dict[str, list[T]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, fn in variants.items():
            if before is not None:
                await before()
            value = await fn()
            if redo_if is not None and redo_if(value):
                if discarded is not None:
                    discarded.setdefault(name, []).append(value)
                if before is not None:
                    await before()
                value = await fn()
            results[name].append(value)
            if on_result is not None:
                on_result(rep, name, value)
    return results



# ---- results --------------------------------------------------------------------------------
def write_results(name: str, data: Mapping[str, Any]) -> Path:
    """Write benchmarks/results/<name>.json atomically (a crashed run never leaves half a file)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def shown_path(path: Path) -> str:
    """`path` relative to the repository when it is inside it (as result files name their plots)."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _json_default(obj: object) -> Any:
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned numbers, for terminals and pasted reports."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def _cell(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


# ---- signals --------------------------------------------------------------------------------
@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the block runs, so `finally:` clauses stop our servers.

    Ctrl-C already raises KeyboardInterrupt; a plain SIGTERM would otherwise kill the benchmark
    and orphan the teacher-server subprocesses it started.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)



def run_and_report(run: Callable[[], dict[str, Any]], name: str, report: Callable[[dict[str, Any]], str],
                   ok: Callable[[dict[str, Any]], bool] = lambda doc: True) -> int:
    """A benchmark's ``main``: run it with SIGTERM stopping its servers, time it, write its results
    under ``name``, print its report and where the file went; exit status 0 when ``ok(doc)``, 1
    when not, 130 when interrupted (nothing written)."""
    started = time.perf_counter()
    try:
        with sigterm_raises():
            doc = run()
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, no results written")
        return 130
    doc["total_wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(name, doc)
    print()
    print(report(doc))
    print(f"\nwrote {path} ({doc['total_wall_s']:.0f} s)")
    return 0 if ok(doc) else 1


def redo_when_loaded(max_foreign_cores: float, max_redos: int) -> Callable[[Any], bool]:
    """An ``interleave`` ``redo_if``: measure again when other processes took more than
    ``max_foreign_cores`` during a measurement (its ``cpu.foreign_cores``), at most ``max_redos``
    times in all, saying so each time."""
    left = [max_redos]

    def contaminated(m: Any) -> bool:
        if m.cpu is None or m.cpu.foreign_cores <= max_foreign_cores or left[0] <= 0:
            return False
        left[0] -= 1
        print(f"  (foreign load {m.cpu.foreign_cores:.2f} cores: measuring again)", flush=True)
        return True

    return contaminated
