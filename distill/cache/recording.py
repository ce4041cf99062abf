"""Fill a teacher-output store from a loader at full teacher throughput: what ``distill record`` runs.

    from distill.cache import record

    result = record(my_loader, cache="/data/kd-cache", teachers="10.0.0.7:8001", inputs=["input_ids",
                    "attention_mask"], key="index", outputs=["LOGITS"], top_k=20, output_dtype="BF16")
    print(result.new_samples, result.samples_per_s)

The loader goes through a :class:`~distill.DistillReader` in ``read_write`` mode, so recording
is the training loop's own data path without the training: batches whose samples are all stored
are skipped (a resumed recording asks no teacher for them), partial hits send only the missing
samples, and the teachers' answers are written by the store's writer thread while the next
batches are in flight. The store's namespace is the teacher's identity and the output settings
given here, so a training run must ask for the same settings to read it.

``distill record ... -- python -m MODULE [ARGS...]`` imports MODULE in-process with
``sys.argv = [MODULE, *ARGS]`` and calls its ``loader()`` (see :func:`loader_from_module`).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, TextIO

from distill.cache.errors import CacheError, StoreNotFoundError

__all__ = ["LoaderContractError", "RecordResult", "loader_from_callable", "loader_from_module", "record"]


class LoaderContractError(CacheError):
    """``distill record`` was given a loader it cannot use: a module without ``loader()``, a
    command other than ``python -m MODULE``, or a callable that does not return an iterable."""


@dataclass(frozen=True)
class RecordResult:
    """What a recording did: samples read from the loader, samples the store gained, how long it took."""

    samples: int  # samples the loader yielded
    new_samples: int  # samples the store gained (asked of a teacher and written)
    stored_before: int
    stored_after: int
    seconds: float

    @property
    def already_stored(self) -> int:
        """Samples skipped because the store held them (a resumed recording), or yielded twice."""
        return self.samples - self.new_samples

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)

    def summary(self, path: str) -> str:
        return (f"recorded {self.new_samples:,} new samples ({self.already_stored:,} of {self.samples:,} already "
                f"stored) into {path} in {self.seconds:.1f} s: {self.samples_per_s:,.1f} samples/s; the store holds "
                f"{self.stored_after:,}")


def _stored(path: str) -> int:
    from distill.cache.store import TeacherOutputStore

    try:
        with TeacherOutputStore.open(path, mode="r") as store:
            return len(store)
    except StoreNotFoundError:
        return 0


def record(
    loader: Iterable[Any],
    *,
    cache: str | os.PathLike[str],
    inputs: Any,
    key: str | int = "index",
    teachers: str | Mapping[str, str] | None = None,
    registry: str | None = None,
    service: str | None = None,
    outputs: Sequence[str] | None = None,
    model: str | None = None,
    model_version: str = "",
    top_k: int = 0,
    output_dtype: str | None = None,
    prefetch: int = 16,
    timeout: float = 30.0,
    progress: bool = True,
    progress_file: TextIO | None = None,
    **reader_options: Any,
) -> RecordResult:
    """Drive ``loader`` through the teachers and store their outputs in ``cache``, keyed by each
    sample's ``key`` field; resumable (stored samples are skipped). Blocking; returns when the
    loader is exhausted and the store's last shard is sealed.

    ``teachers``/``registry``/``service``/``inputs``/``outputs``/``model``/``top_k``/``output_dtype``
    mean what they mean to :class:`~distill.DistillReader` (so do ``reader_options``: TLS, headers,
    the router's tuning); a progress bar goes to ``progress_file`` (stderr) unless ``progress`` is False.
    Raises what the reader raises (no teacher, a mismatched store, a rejected batch).
    """
    from tqdm import tqdm

    from distill.cache.reader_side import batch_keys
    from distill.reader import DistillReader

    path = os.fspath(cache)
    before = _stored(path)
    reader = DistillReader(
        loader, teachers=teachers, registry=registry, service=service, inputs=inputs, outputs=outputs, model=model,
        model_version=model_version, top_k=top_k, output_dtype=output_dtype, prefetch=prefetch, timeout=timeout,
        cache=path, cache_mode="read_write", key=key, **reader_options,
    )
    total = len(loader) if isinstance(loader, Sized) else None
    started = time.perf_counter()
    samples = 0
    with reader, tqdm(total=total, unit="batch", disable=not progress, file=progress_file or sys.stderr) as bar:
        for batch, _ in reader:
            n = len(batch_keys(batch, key))
            samples += n
            _wait_for_writer(reader, samples, n)
            bar.update(1)
    elapsed = time.perf_counter() - started  # the reader's close (the last shard sealed) is inside
    after = _stored(path)
    return RecordResult(samples, after - before, before, after, elapsed)


def _wait_for_writer(reader: Any, samples: int, per_batch: int, timeout_s: float = 300.0) -> None:
    """Hold the loop while the store's writer is more than half its queue behind the samples delivered.

    A training reader drops what its writer cannot keep up with (the loop never waits on the disk;
    the dropped samples are asked of a teacher again next time); recording is only the writing, so
    it waits instead and the store gains every sample in one pass. Bounded: after `timeout_s` it
    goes on (and what is dropped is recorded by a resumed run)."""
    from distill.cache.reader_side import WRITE_QUEUE_BATCHES

    # Batches read ahead are queued for the writer, or counted as hits, before the loop sees them.
    ahead = 2 * int(getattr(reader.options, "prefetch", 0))
    allowed = max(1, WRITE_QUEUE_BATCHES // 2 - ahead) * max(per_batch, 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = reader.stats()
        if samples - stats.cache_hits - stats.cache_written <= allowed:
            return
        time.sleep(0.002)


def loader_from_callable(spec: str) -> Iterable[Any]:
    """``--loader MODULE:FUNCTION``: import MODULE, call FUNCTION() (a dotted path inside the module
    is followed), return what it returns (an attribute that is not callable is the loader itself)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise LoaderContractError(f"--loader {spec!r}: expected MODULE:FUNCTION, e.g. my_dataset:train_loader")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        if not hasattr(fn, part):
            raise LoaderContractError(f"--loader {spec!r}: module {module!r} has no {name!r}")
        fn = getattr(fn, part)
    return _checked(fn() if callable(fn) else fn, f"--loader {spec}")


def loader_from_module(command: Sequence[str]) -> Iterable[Any]:
    """The loader of ``python -m MODULE [ARGS...]`` (what follows ``--`` on ``distill record``).

    The contract: MODULE is imported in this process (its ``if __name__ == "__main__":`` block does
    not run) with ``sys.argv = [MODULE, *ARGS]`` while it is imported and while ``loader()`` runs,
    so a module that parses its own flags in ``loader()`` sees ARGS; it must define ``loader()``, a
    function of no arguments returning the iterable of batches (a DataLoader, a list, a generator).
    """
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if len(argv) < 3 or not os.path.basename(argv[0]).startswith("python") or argv[1] != "-m":
        raise LoaderContractError(
            f"after --, distill record takes `python -m MODULE [ARGS...]`, got {' '.join(argv) or 'nothing'!r}; "
            "MODULE must define loader() returning the iterable of batches (or use --loader MODULE:FUNCTION)")
    module, args = argv[2], argv[3:]
    saved = sys.argv
    sys.argv = [module, *args]
    try:
        mod = importlib.import_module(module)
        fn = getattr(mod, "loader", None)
        if not callable(fn):
            raise LoaderContractError(
                f"module {module!r} ({getattr(mod, '__file__', '?')}) defines no loader(): distill record imports "
                "it with sys.argv = [MODULE, *ARGS] and calls its loader(), a function of no arguments returning "
                "the iterable of batches (dicts holding the teacher inputs and the key field); add one")
        return _checked(fn(), f"{module}.loader()")
    finally:
        sys.argv = saved


def _checked(loader: Any, what: str) -> Iterable[Any]:
    if not isinstance(loader, Iterable):
        raise LoaderContractError(f"{what} returned a {type(loader).__name__}, not an iterable of batches")
    return loader
