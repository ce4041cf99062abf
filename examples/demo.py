"""`make demo` / `distill-demo`: a real distillation through the mesh, on this machine.

1. starts a local etcd (the registry);
2. trains the digits teacher (a small CNN on scikit-learn's digits), or loads it from the cache;
3. starts `distill-autoscaler` with the local backend and an empty pool (--min 0): the first
   student's demand makes it start a teacher-server, which registers itself in etcd;
4. trains a student through the mesh (DistillReader + KDLoss), then the same student without KD;
   with no student left, the autoscaler drains the teacher;
5. prints the results table and writes a PNG of student throughput and teachers over time.

Every process it starts is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from discovery import open_registry
from discovery.etcd import EtcdRegistry
from discovery.local_etcd import LocalEtcd
from examples.common import StudentResult, cache_dir, exit_on_sigterm
from examples.cv import teacher as cv_teacher
from examples.cv.train_student import StudentConfig, reader_source, train_student
from examples.cv.train_teacher import train_teacher
from teacher_server import launch

SERVICE = "demo-digits"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Timeline:
    """What the registry showed every half second, from a sampler thread."""

    started: float = field(default_factory=time.monotonic)
    points: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[tuple[float, float, str]] = field(default_factory=list)  # (t, samples/s, label)
    decisions: list[tuple[float, str]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, label: str) -> None:
        self.marks.append((self.now(), label))

    def drained(self) -> bool:
        """A teacher was registered at some point, and none is now."""
        points = list(self.points)
        return any(p["teachers"] > 0 for p in points) and points[-1]["teachers"] == 0

    def epoch_meter(self, samples_per_epoch: int, label: str) -> Any:
        """An on_epoch callback recording the student's own throughput, epoch by epoch."""
        last = [self.now()]

        def on_epoch(epoch: int, accuracy: float) -> None:
            now = self.now()
            self.epochs.append((now, samples_per_epoch / max(now - last[0], 1e-6), label))
            last[0] = now

        return on_epoch


def _say(text: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(text)
    except ImportError:  # pragma: no cover - tqdm comes with the examples extra
        print(text, flush=True)


@contextlib.contextmanager
def sampling(address: str, timeline: Timeline, interval: float = 0.5) -> Iterator[None]:
    """Poll teachers, student demand and the autoscaler's decision until the block ends."""
    stop = threading.Event()

    async def run() -> None:
        async with open_registry(address, timeout=2.0) as reg:
            last_reason, last_scale_at = "", None
            while not stop.is_set():
                try:
                    teachers = await reg.teachers(SERVICE)
                    demand = await reg.demand(SERVICE)
                    decision = await reg.autoscaler_decision(SERVICE) if isinstance(reg, EtcdRegistry) else None
                except Exception:  # etcd busy or restarting: skip this sample
                    await asyncio.sleep(interval)
                    continue
                timeline.points.append({
                    "t": timeline.now(), "teachers": len(teachers),
                    "student_samples_per_s": sum(d.samples_per_s for d in demand),
                    "stall": max((d.wait_fraction for d in demand), default=0.0),
                })
                if decision is not None:
                    # Every scale that landed, from the record's last_scale (the decision that made it
                    # may be replaced before this poll); besides, each change of the hold's kind.
                    scaled = decision.get("last_scale")
                    reason = str(decision.get("reason", ""))
                    if isinstance(scaled, dict) and scaled.get("at") != last_scale_at:
                        last_scale_at = scaled.get("at")
                        last_reason = reason = str(scaled.get("reason", ""))
                    elif decision.get("action") != "hold" or reason.split(":", 1)[0] == last_reason.split(":", 1)[0]:
                        reason = ""
                    else:
                        last_reason = reason
                    if reason:
                        timeline.decisions.append((timeline.now(), reason))
                        _say(f"  [{timeline.now():5.1f}s] autoscaler: {reason[:150]}")
                await asyncio.sleep(interval)

    thread = threading.Thread(target=lambda: asyncio.run(run()), name="demo-sampler", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@contextlib.contextmanager
def autoscaler(address: str, log_dir: Path, *, max_teachers: int, down_window: float,
               weights: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`distill-autoscaler` with the local backend; SIGTERM on exit drains its teachers."""
    cmd = [
        sys.executable, "-m", "distill.autoscale", "--registry", address, "--service", SERVICE,
        "--backend", "local", "--min", "0", "--max", str(max_teachers), "--period", "0.5",
        "--down-window", str(down_window), "--grace", "10", "--log-dir", str(log_dir),
        "--", sys.executable, "-m", "teacher_server", "--model", "examples.cv.teacher:build",
        "--name", "digits", "--device", "cpu", "--max-batch-size", "256", "--ttl", "5",
    ]
    proc = launch.spawn(cmd, log=log_dir / "autoscaler.log", env={cv_teacher.WEIGHTS_ENV: str(weights)}, cwd=REPO)
    try:
        yield proc
    finally:
        launch.stop(proc, grace=30.0)


def plot(timeline: Timeline, path: Path) -> Path | None:
    """Student throughput and teacher count over time; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [p["t"] for p in timeline.points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for label, color in (("KD", "tab:blue"), ("no KD", "tab:green")):
        pts = [(e[0], e[1]) for e in timeline.epochs if e[2] == label]
        if pts:
            top.plot(*zip(*pts, strict=True), color=color, label=f"student {label}, per epoch")
    top.plot(t, [p["student_samples_per_s"] for p in timeline.points], color="tab:blue", linestyle="--",
             linewidth=1, label="published to etcd (10 s window)")
    top.set_ylabel("student samples/s")
    top.set_yscale("log")  # the toy student without a teacher runs ~10x faster than any RPC round trip
    top.legend(loc="upper left", fontsize=8)
    top.set_title("distill-mesh demo: a student distilling from an autoscaled teacher pool")
    bottom.step(t, [p["teachers"] for p in timeline.points], where="post", color="tab:orange")
    bottom.set_ylabel("teachers registered")
    bottom.set_xlabel("seconds since the demo started")
    bottom.set_yticks(range(0, max([p["teachers"] for p in timeline.points] + [1]) + 1))
    for when, label in timeline.marks:
        for ax in (top, bottom):
            ax.axvline(when, color="grey", linestyle=":", linewidth=1)
        top.annotate(label, (when, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                     fontsize=8, color="grey")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def teachers_over_time(timeline: Timeline) -> str:
    steps: list[str] = []
    last = None
    for p in timeline.points:
        if p["teachers"] != last:
            last = p["teachers"]
            steps.append(f"{last} (t={p['t']:.0f}s)")
    return " -> ".join(steps) or "no samples"


def table(teacher_acc: float, kd: list[StudentResult], plain: list[StudentResult], timeline: Timeline) -> str:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    kd_acc, plain_acc = mean([r.test_accuracy for r in kd]), mean([r.test_accuracy for r in plain])
    rows = [
        ("teacher (CNN, 3 conv layers)", f"{teacher_acc:.1%}", "", "", ""),
        ("student MLP, with KD (mesh)", f"{kd_acc:.1%}", f"{mean([r.samples_per_s for r in kd]):,.0f}",
         f"{mean([r.stall_fraction for r in kd]):.1%}", str(max(r.teachers_in_use for r in kd))),
        ("student MLP, without KD", f"{plain_acc:.1%}", f"{mean([r.samples_per_s for r in plain]):,.0f}", "", ""),
    ]
    head = ("model", "test accuracy", "samples/s", "stall", "teachers")
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(5)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    seeds = ", ".join(str(r.seed) for r in kd)
    lines.append(f"KD gain: {100 * (kd_acc - plain_acc):+.1f} points (seeds {seeds}, same seeds for both students)")
    lines.append(f"teachers over time: {teachers_over_time(timeline)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distill-demo", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--fast", action="store_true", help="a seconds-long run (few epochs): for tests")
    p.add_argument("--seeds", default="0", help="student seeds, comma-separated (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=None, help="student epochs (default 60; 3 with --fast)")
    p.add_argument("--max-teachers", type=int, default=2, help="autoscaler's --max (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="where to write the PNG and JSON (default: the cache)")
    p.add_argument("--retrain", action="store_true", help="train the teacher even when it is cached")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out_dir = args.out or cache_dir() / "demo"
    config = StudentConfig(epochs=args.epochs or (3 if args.fast else StudentConfig.epochs))
    down_window = 2.0 if args.fast else 5.0
    timeline = Timeline()
    started = time.perf_counter()

    weights = cv_teacher.weights_path()
    if args.retrain or not weights.is_file():
        print(f"training the teacher on scikit-learn's digits (cached at {weights}) ...", flush=True)
        train_teacher(weights, epochs=2 if args.fast else 15, progress=True)
    else:
        print(f"teacher loaded from the cache: {weights}", flush=True)
    teacher_acc = float(cv_teacher.read_info(weights).get("test_accuracy", float("nan")))

    with tempfile.TemporaryDirectory(prefix="distill-demo-") as tmp, LocalEtcd() as etcd:
        print(f"etcd at {etcd.address}; starting distill-autoscaler (local backend, pool of 0..{args.max_teachers})",
              flush=True)
        with sampling(etcd.address, timeline), autoscaler(etcd.address, Path(tmp), max_teachers=args.max_teachers,
                                                          down_window=down_window, weights=weights) as scaler:
            kd_results, plain_results = [], []
            for seed in seeds:
                timeline.mark(f"KD student (seed {seed})")
                source = reader_source(registry=etcd.address, service=SERVICE, no_teacher_timeout=90.0)
                kd_results.append(train_student(replace(config, seed=seed), source, progress=True,
                                                on_epoch=timeline.epoch_meter(config.train_size, "KD")))
            timeline.mark("no-KD student")
            for seed in seeds:
                plain_results.append(train_student(replace(config, seed=seed), None, progress=True,
                                                   on_epoch=timeline.epoch_meter(config.train_size, "no KD")))
            timeline.mark("students done")
            # Let the autoscaler drain the pool, so the plot shows it: done once a teacher was seen
            # and the count is back to 0 (a short KD phase may end before the sampler saw it at all).
            deadline = time.monotonic() + down_window + 15
            while time.monotonic() < deadline and not timeline.drained():
                time.sleep(0.5)
            if scaler.poll() is not None:
                print(f"warning: the autoscaler exited early with code {scaler.returncode}; its log is in "
                      f"{tmp}/autoscaler.log", file=sys.stderr)

    print()
    print(table(teacher_acc, kd_results, plain_results, timeline))
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(timeline, out_dir / "distill-demo.png")
    results = {
        "teacher_accuracy": teacher_acc, "seconds": round(time.perf_counter() - started, 1),
        "kd": [vars(r) for r in kd_results], "no_kd": [vars(r) for r in plain_results],
        "timeline": timeline.points, "decisions": timeline.decisions, "marks": timeline.marks,
    }
    (out_dir / "distill-demo.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"plot: {png}" if png else "plot: skipped (install matplotlib)")
    print(f"results: {out_dir / 'distill-demo.json'} ({results['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the teacher servers and etcd it starts stop with it
    sys.exit(main())
