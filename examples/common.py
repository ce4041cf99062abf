"""What the example scripts share (CV, NLP, elastic): where trained weights live and how they are
saved and loaded (`TeacherFiles`), seeding, accuracy, the student training loop (`fit_student`),
result files, progress bars, a teacher-server subprocess that always stops, and the `serve`
command line that both the CV and the NLP example expose (`serve_main`). Each example keeps what
is its own: data, models, and the few settings these take.

Why a cache directory: training the teacher is the slow step; the scripts that serve or export it
(and `make demo`) find its weights at one well-known path instead of retraining every time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

import distill
from teacher_server import launch

CACHE_ENV = "DISTILL_MESH_CACHE"

Outputs = dict[str, torch.Tensor] | None
"""A batch's teacher outputs ({name: tensor}), or None (no KD, or the reader's hard-label fallback)."""

Source = Callable[[Iterable[Any]], AbstractContextManager[Iterable[tuple[Any, Outputs]]]]
"""Given a run's loader, a context manager yielding an iterable of ``(batch, teacher outputs)``, one
pass per epoch: a ``DistillReader`` in real use (``reader_source``), no teacher for the baseline
(``no_teacher``), or an in-process teacher in experiments."""


@dataclass(frozen=True)
class StudentResult:
    """The outcome of one student run. ``stall_fraction``: share of wall time the training loop
    waited for its next batch (teacher outputs included); ``teachers_in_use`` at the end."""

    seed: int
    kd: bool
    test_accuracy: float
    seconds: float
    samples: int
    samples_per_s: float
    stall_fraction: float
    teachers_in_use: int = 0


class StallTimer:
    """Adds up how long each ``next()`` of the wrapped iterable took: the loop's stall time."""

    def __init__(self) -> None:
        self.waited = 0.0

    def wrap(self, items: Iterable[Any]) -> Iterator[Any]:
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.waited += time.perf_counter() - t0
                return
            self.waited += time.perf_counter() - t0
            yield item


class _Plain:
    def __init__(self, loader: Iterable[Any]) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[tuple[Any, Outputs]]:
        return ((b, None) for b in self._loader)


@contextlib.contextmanager
def no_teacher(loader: Iterable[Any]) -> Iterator[Iterable[tuple[Any, Outputs]]]:
    """The baseline's source: the loader's batches, each with ``None`` teacher outputs."""
    yield _Plain(loader)


def reader_source(*, inputs: Sequence[str], outputs: Sequence[str], **options: Any) -> Source:
    """A source that distils through the mesh: ``DistillReader(loader, inputs=..., outputs=..., **options)``.

    ``options`` say where the teachers are (``teachers=`` or ``registry=`` + ``service=``, as
    ``distill.distill_options_from_args`` returns them) and how to ask (``top_k=``, ``output_dtype=``).
    """

    @contextlib.contextmanager
    def source(loader: Iterable[Any]) -> Iterator[Iterable[tuple[Any, Outputs]]]:
        with distill.DistillReader(loader, inputs=list(inputs), outputs=list(outputs), **options) as reader:
            yield reader

    return source


def teachers_in_use(batches: object) -> int:
    """How many teachers a source used (a ``DistillReader``'s stats), 0 for other sources."""
    stats = getattr(batches, "stats", None)
    return int(stats().teachers_in_use) if callable(stats) else 0


def fit_student(
    student: nn.Module,
    loader: Iterable[Any],
    source: Source | None,
    *,
    seed: int,
    epochs: int,
    lr: float,
    temperature: float,
    alpha: float,
    input_name: str,
    test: tuple[torch.Tensor, torch.Tensor],
    soft_targets: Callable[[Outputs], Any] | None = None,
    desc: str = "student",
    progress: bool = False,
    on_epoch: Callable[[int, float], None] | None = None,
) -> StudentResult:
    """The training loop both examples' students share: Adam, ``KDLoss`` with a ``source`` (teacher
    outputs), plain cross-entropy without; returns the run's accuracy, throughput and stall.

    ``soft_targets(teacher outputs)`` turns a batch's outputs into what ``KDLoss`` takes (default:
    the ``LOGITS`` tensor, None when the reader fell back to hard labels); ``test`` is ``(x, y)``.
    ``on_epoch(epoch, test_accuracy)`` is called after every epoch (the demo plots from it). Seed
    and build ``student`` before calling: its initial weights are the caller's to fix.
    """
    targets = soft_targets or (lambda teacher: teacher["LOGITS"] if teacher is not None else None)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    kd = distill.KDLoss(temperature=temperature, alpha=alpha) if source is not None else None
    ce = nn.CrossEntropyLoss()
    timer, samples = StallTimer(), 0
    bar = progress_bar(epochs, desc, progress)
    started = time.perf_counter()
    with (source or no_teacher)(loader) as batches:
        for epoch in range(epochs):
            student.train()
            for batch, teacher in timer.wrap(batches):
                logits = student(batch[input_name])
                loss = ce(logits, batch["label"]) if kd is None else kd(logits, targets(teacher), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                samples += len(batch["label"])
            if on_epoch is not None or bar is not None:
                acc = accuracy(student, *test)
                if on_epoch is not None:
                    on_epoch(epoch, acc)
                if bar is not None:
                    bar.set_postfix(test_acc=f"{acc:.3f}")
                    bar.update()
        used = teachers_in_use(batches)
    seconds = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return StudentResult(
        seed=seed, kd=kd is not None, test_accuracy=accuracy(student, *test),
        seconds=seconds, samples=samples, samples_per_s=samples / max(seconds, 1e-9),
        stall_fraction=min(1.0, timer.waited / max(seconds, 1e-9)), teachers_in_use=used,
    )


def cache_dir() -> Path:
    """``$DISTILL_MESH_CACHE``, else ``$XDG_CACHE_HOME/distill-mesh``, else ``~/.cache/distill-mesh``.

    Not created here; writers create it. An environment variable rather than a flag because the
    teacher-server imports ``module:factory`` with no arguments: the cache path must reach it
    through the environment.
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "distill-mesh"


M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class TeacherFiles:
    """Where an example's trained teacher lives, and how it is saved and loaded.

    The weights are ``$<weights_env>`` if set, else ``<cache dir>/<example>/teacher.pt``, with a
    JSON summary beside them (test accuracy, epochs, seed; the demo's table reads it). A factory
    such as ``examples.cv.teacher:build`` takes no arguments, so it finds them here.
    """

    example: str  # "cv", "nlp": the package under examples/ and the cache subdirectory
    weights_env: str
    label: str  # "CV", "NLP": for messages

    def weights_path(self) -> Path:
        """Where the teacher's state dict is read from (and written to by default)."""
        explicit = os.environ.get(self.weights_env)
        return Path(explicit).expanduser() if explicit else cache_dir() / self.example / "teacher.pt"

    @staticmethod
    def info_path(weights: Path) -> Path:
        """The JSON summary next to the weights."""
        return weights.with_suffix(".json")

    def read_info(self, weights: Path | None = None) -> dict[str, Any]:
        """The training summary saved with the weights ({} if there is none)."""
        try:
            data: dict[str, Any] = json.loads(self.info_path(weights or self.weights_path()).read_text())
        except (OSError, ValueError):
            return {}
        return data

    def load(self, model: M, weights: str | os.PathLike[str] | None = None) -> M:
        """``model`` with the trained weights, in eval mode; ``ModelLoadError`` saying which script to
        run when there are none. ``torch.load(weights_only=True)``: a weights file is data, and
        loading it must not be able to run code, whoever wrote the cache directory."""
        from teacher_server.model import ModelLoadError

        path = Path(weights) if weights is not None else self.weights_path()
        if not path.is_file():
            raise ModelLoadError(
                f"no trained {self.label} teacher at {path}: run `python -m examples.{self.example}.train_teacher` "
                f"first (or point ${self.weights_env} at a state dict)"
            )
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()

    def save(self, model: nn.Module, out: Path, info: Mapping[str, Any]) -> None:
        """The state dict to ``out`` (atomically: a server starting meanwhile never reads half a
        file) and ``info`` beside it."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(out)
        write_json(self.info_path(out), info)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python's and torch's global generators; return a fresh generator for data order.

    KD and no-KD runs with the same seed then start from the same student weights and see the
    same batches in the same order, so the loss is the only difference between them.
    """
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@torch.inference_mode()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``, in eval mode (restores the previous mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((model(x[i : i + batch_size]).argmax(dim=1) == y[i : i + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(x))


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(target)


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]`` (for ``--seeds``)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds needs at least one seed")
    return seeds


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar (``leave=False``), or None when disabled or tqdm is missing; callers check for None."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the examples extra
        return None
    return tqdm(total=total, desc=desc, unit="epoch", leave=False)


@contextlib.contextmanager
def teacher_server_process(args: Sequence[str], timeout: float = 60.0) -> Iterator[str]:
    """Run ``python -m teacher_server ARGS`` until the block ends; yield its endpoint.

    Pass ``--port 0`` in ``args`` for a free port. Readiness comes from ``--ready-file`` (written
    once the server serves), not from sleeping; ``launch.TeacherStartError`` (a RuntimeError) if
    it exits first or is not ready within ``timeout`` s. On exit, SIGTERM (the server drains and
    deregisters), then SIGKILL after 30 s: the process never outlives the block. Its warnings go
    to this process's terminal.
    """
    with launch.TeacherProcess([*args, "--log-level", "WARNING"], label="example-teacher", inherit_output=True,
                               ready_timeout=timeout, stop_grace=30.0) as server:
        yield server.endpoint


@dataclass(frozen=True)
class ServeCommand:
    """What differs between the examples' ``serve`` scripts; `serve_main` is the rest.

    ``teacher_args(source=, port=, device=, registry=, service=, extra=)`` builds the
    teacher-server arguments; ``check_files(source)`` says which script to run first (None when
    the model can be served); ``smoke(args)`` serves briefly with ``args`` and returns an exit code.
    """

    example: str  # "cv", "nlp": the package under examples/
    description: str
    default_port: int
    service: str
    sources: tuple[str, ...]
    weights_env: str
    teacher_args: Callable[..., list[str]]
    check_files: Callable[[str], str | None]
    smoke: Callable[[list[str]], int]
    smoke_help: str = "serve briefly on a free port, check one request, stop"
    from_help: str = "serve the module:factory, or a file written by the example's export script"


def build_serve_parser(cmd: ServeCommand) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m examples.{cmd.example}.serve", description=cmd.description)
    p.add_argument("--from", dest="source", choices=cmd.sources, default="factory",
                   help=f"{cmd.from_help} (default: %(default)s)")
    p.add_argument("--port", type=int, default=cmd.default_port, help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default: %(default)s)")
    p.add_argument("--registry", default=None, help="etcd://HOST:PORT: register so students find it")
    p.add_argument("--service", default=cmd.service, help="service name in the registry (default: %(default)s)")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the command, do not run it")
    p.add_argument("--smoke", action="store_true", help=cmd.smoke_help)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more teacher-server flags")
    return p


def serve_main(cmd: ServeCommand, argv: Sequence[str] | None = None) -> int:
    """Print the exact teacher-server command, then become that server (or only print, or smoke-test)."""
    from teacher_server.model import ModelLoadError

    args = build_serve_parser(cmd).parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    server_args = cmd.teacher_args(source=args.source, port=args.port, device=args.device, registry=args.registry,
                                   service=args.service, extra=extra)
    env_note = f"{cmd.weights_env}={shlex.quote(os.environ[cmd.weights_env])} " if cmd.weights_env in os.environ else ""
    print(f"{env_note}teacher-server {shlex.join(server_args)}", flush=True)
    if args.print_only:
        return 0
    problem = cmd.check_files(args.source)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    if args.smoke:
        try:
            return cmd.smoke(cmd.teacher_args(source=args.source, port=0, device=args.device, registry=args.registry,
                                              service=args.service, extra=extra))
        except (ModelLoadError, RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    # Become the server: signals go straight to it, and it drains on SIGTERM.
    os.execv(sys.executable, [sys.executable, "-m", "teacher_server", *server_args])
    return 0  # pragma: no cover - execv does not return


def print_result(r: StudentResult, label: str) -> None:
    """One line per finished seed, flushed (long runs show progress in logs too)."""
    print(f"seed {r.seed}: {label} student test accuracy {r.test_accuracy:.4f} ({r.samples:,} samples in "
          f"{r.seconds:.1f} s, {r.samples_per_s:,.0f} samples/s, stall {100 * r.stall_fraction:.1f}%)", flush=True)


def summarize(results: Sequence[StudentResult], label: str, json_path: str | os.PathLike[str] | None = None,
              **extra: Any) -> float:
    """Print the mean ± stdev over seeds, optionally write every run (and ``extra``) as JSON; return the mean."""
    accs = [r.test_accuracy for r in results]
    mean = statistics.fmean(accs)
    spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
    seeds = ",".join(str(r.seed) for r in results)
    print(f"{label}: mean test accuracy {mean:.4f} ± {spread:.4f} over seeds {seeds}")
    if json_path is not None:
        write_json(json_path, {"label": label, "mean_test_accuracy": mean, "stdev": spread,
                               "runs": [asdict(r) for r in results], **extra})
    return mean


def exit_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does: a SystemExit (status 143) in the main thread.

    Python's own SIGTERM ends the process at once, without running ``finally:`` or ``__exit__``, so
    the teacher servers and the etcd an example started (context managers) would outlive it. Call it
    from an example's ``__main__`` guard, in the main thread, before starting them.
    """

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
