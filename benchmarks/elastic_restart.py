"""Elastic restart, repeated: does every rank of a restarted ``torchrun`` group exit 0?

    python -m benchmarks.elastic_restart --runs 8            # serves the CV teacher itself
    python -m benchmarks.elastic_restart --runs 8 --teacher 127.0.0.1:9898

One uninterrupted two-rank ``--smoke`` run gives the reference accuracy; then ``--runs`` times the
crash-and-restart scenario of ``examples/elastic/README.md`` (two ranks, the last rank dies after
epoch 0, ``torchrun --max-restarts 1`` restarts the group, which resumes from the checkpoint);
then a two-rank run killed after epoch 0 with no restart, resumed by a one-rank run from the same
checkpoint. Every run must exit 0 (the killed one must fail) and print the reference accuracy.
The teacher is the CV example's, trained in smoke mode into a private cache unless one exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.servers import ServerThread

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
_ACCURACY = re.compile(r"^KD \((\d+) ranks?\): mean test accuracy ([0-9.]+)", re.M)


@dataclass
class Run:
    """One ``torchrun`` invocation: its exit status, the accuracy it printed and what it said."""

    kind: str
    returncode: int
    accuracy: float | None
    world: int | None
    resumed: bool
    crashed: bool
    aborted: bool  # "terminate called" in the output: a C++ abort at exit
    seconds: float
    output: str

    def summary(self) -> str:
        return (f"{self.kind}: exit {self.returncode}, accuracy {self.accuracy}, world {self.world}, "
                f"resumed {self.resumed}, crashed {self.crashed}, aborted {self.aborted}, {self.seconds:.1f} s")


def torchrun(kind: str, teacher: str, checkpoint: Path | None, *, nproc: int = 2, max_restarts: int = 0,
             crash_after_epoch: int | None = None, env: dict[str, str] | None = None,
             timeout: float = 240.0, json_out: Path | None = None) -> Run:
    """Run ``examples.elastic.train --smoke`` under a real torchrun and parse what it printed
    (``json_out``: where rank 0 writes the results JSON; none by default)."""
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
           "-m", "examples.elastic.train", "--smoke", "--seeds", "0", "--distill_teachers", teacher]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    if json_out is not None:
        cmd += ["--json", str(json_out)]
    if crash_after_epoch is not None:
        cmd += ["--crash_after_epoch", str(crash_after_epoch)]
    started = time.perf_counter()
    # Should a worker abort, Python's fault handler prints where every Python thread was.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    text = out.stdout + out.stderr
    m = _ACCURACY.search(out.stdout)
    return Run(kind=kind, returncode=out.returncode, accuracy=float(m.group(2)) if m else None,
               world=int(m.group(1)) if m else None, resumed="resuming from" in out.stdout,
               crashed="simulated crash" in text, aborted="terminate called" in text,
               seconds=time.perf_counter() - started, output=text)


def scenario(teacher: str, workdir: Path, runs: int, env: dict[str, str] | None = None) -> list[Run]:
    """The reference run, ``runs`` crash-and-restart runs, and the 2-rank -> 1-rank resume. Every
    run names a file in ``workdir`` on its command line (the reference run its results JSON,
    ``uninterrupted.json``; the others their checkpoint), so ``pgrep -f <workdir>`` finds any
    worker a run left behind."""
    results = [torchrun("uninterrupted", teacher, None, env=env, json_out=workdir / "uninterrupted.json")]
    for i in range(runs):
        ck = workdir / f"restart-{i}.pt"
        results.append(torchrun("crash+restart", teacher, ck, max_restarts=1, crash_after_epoch=0, env=env))
    ck = workdir / "resize.pt"
    results.append(torchrun("killed (2 ranks)", teacher, ck, max_restarts=0, crash_after_epoch=0, env=env))
    results.append(torchrun("resumed (1 rank)", teacher, ck, nproc=1, env=env))
    return results


def problems(results: Sequence[Run]) -> list[str]:
    """What went wrong, as sentences; empty when every run did what the README says."""
    bad: list[str] = []
    reference = results[0].accuracy
    if results[0].returncode != 0 or reference is None:
        return [f"the uninterrupted run failed: {results[0].summary()}\n{results[0].output[-3000:]}"]
    for r in results[1:]:
        if r.kind == "killed (2 ranks)":
            if r.returncode == 0 or not r.crashed:
                bad.append(f"the killed run did not fail as planned: {r.summary()}")
            continue
        if r.returncode != 0 or r.aborted:
            bad.append(f"{r.summary()}\n{r.output[-3000:]}")
        elif not r.resumed:
            bad.append(f"did not resume from the checkpoint: {r.summary()}")
        elif r.kind == "crash+restart" and (not r.crashed or r.accuracy != reference or r.world != 2):
            bad.append(f"restart differs from the uninterrupted run ({reference}): {r.summary()}")
        elif r.kind == "resumed (1 rank)" and (r.world != 1 or r.accuracy is None):
            bad.append(f"the one-rank resume did not finish: {r.summary()}")
    return bad


def _serve(cache: Path) -> ServerThread:
    """Train (smoke) and serve the CV teacher in this process (stop it with ``__exit__``)."""
    os.environ["DISTILL_MESH_CACHE"] = str(cache)
    from examples.cv import serve as cv_serve
    from examples.cv import train_teacher as cv_teacher
    from teacher_server import BatchingConfig, ServerConfig
    from tests.servers import ServerThread

    if not (cache / "cv" / "teacher.pt").is_file():
        assert cv_teacher.main(["--smoke"]) == 0
    srv = ServerThread(ServerConfig(model="examples.cv.teacher:build", name=cv_serve.MODEL_NAME, device="cpu",
                                    batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=500)))
    return srv.__enter__()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_restart", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=8, help="crash-and-restart runs (default: %(default)s)")
    p.add_argument("--teacher", default=None, help="host:port of a served CV teacher (default: serve one here)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="elastic-restart-") as tmp:
        work = Path(tmp)
        server: ServerThread | None = None
        env: dict[str, str] = {}
        if args.teacher is None:
            server = _serve(work / "cache")
            teacher = server.url
            env["DISTILL_MESH_CACHE"] = str(work / "cache")
        else:
            teacher = args.teacher
        try:
            results = scenario(teacher, work, args.runs, env)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
    for r in results:
        print(r.summary())
    restarts = [r for r in results if r.kind == "crash+restart"]
    clean = sum(r.returncode == 0 and not r.aborted for r in restarts)
    print(f"crash+restart: {clean}/{len(restarts)} exited 0; machine: {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    bad = problems(results)
    for b in bad:
        print("PROBLEM:", b, file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "output"} for r in results],
                                        indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
