"""Shared pieces of the fault suite: a paced, tagged loader, an epoch runner that checks delivery
and outputs and measures stalls, and a background event loop for asyncio-only tools (TcpProxy,
etcd queries) used from the synchronous training loop."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from discovery import open_registry
from distill import DistillReader
from tests.models import Affine
from tests.servers import teacher_process

_T = TypeVar("_T")

AFFINE = Affine()
ROWS = 8


def expected(x: torch.Tensor) -> torch.Tensor:
    """What the teacher must answer: the same model, run in this process."""
    with torch.inference_mode():
        return AFFINE(x)


def make_batch(i: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """Batch ``i``: deterministic inputs and an ``idx`` tag so loss, duplication and reordering show."""
    g = torch.Generator().manual_seed(1000 + i)
    return {"X": torch.randn(rows, 8, generator=g), "idx": torch.full((rows,), i)}


class PacedLoader:
    """A loader whose epoch lasts as long as the fault needs, and no longer than ``max_batches``.

    It yields tagged batches, sleeping ``pace_s`` before each (a data pipeline's own cost, which
    also stretches the epoch over process restarts). Once ``stop`` is set it yields ``tail`` more
    batches and ends, so a scenario can say "done" from another thread. ``count`` is the number of
    batches yielded in the last pass: the delivered sequence must equal ``range(count)``.
    """

    def __init__(self, max_batches: int, pace_s: float = 0.0, tail: int = 20, rows: int = ROWS) -> None:
        self.max_batches = max_batches
        self.pace_s = pace_s
        self.tail = tail
        self.rows = rows
        self.stop = threading.Event()
        self.count = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.count = 0
        left = self.tail
        for i in range(self.max_batches):
            if self.stop.is_set():
                if left <= 0:
                    return
                left -= 1
            if self.pace_s:
                time.sleep(self.pace_s)
            self.count = i + 1
            yield make_batch(i, self.rows)


@dataclass
class EpochResult:
    """What one epoch delivered and how long the training loop waited at worst."""

    seen: list[int] = field(default_factory=list)
    max_stall_s: float = 0.0
    stall_before_batch: int = -1


def run_epoch(reader: DistillReader, on_batch: Callable[[int], None] | None = None) -> EpochResult:
    """Iterate one epoch, checking every batch's teacher outputs against the in-process model.

    The stall is the largest gap between two consecutive deliveries (start-up excluded: it is
    connection set-up, not a fault). ``on_batch(i)`` runs after batch ``i`` is checked; that is
    where scenarios inject their faults, from the training loop itself.
    """
    result = EpochResult()
    last: float | None = None
    for batch, teacher in reader:
        now = time.monotonic()
        i = int(batch["idx"][0])
        result.seen.append(i)
        if last is not None and now - last > result.max_stall_s:
            result.max_stall_s, result.stall_before_batch = now - last, i
        assert teacher is not None, f"batch {i} came without teacher outputs"
        assert torch.allclose(teacher["Y"], expected(batch["X"]), atol=1e-5), f"batch {i} has wrong outputs"
        if on_batch is not None:
            on_batch(i)
        last = time.monotonic()  # the loop's own work (fault injection included) is not a stall
    return result


def assert_exactly_once(result: EpochResult, count: int) -> None:
    """0 lost, 0 duplicated, in order: the delivered tags are exactly 0..count-1."""
    assert_delivered_once_in_order(result.seen, count)


def assert_delivered_once_in_order(seen: Sequence[int], count: int) -> None:
    """The batch tags delivered in one epoch are exactly 0..count-1 in order; the message names the
    lost and duplicated tags, or says the order broke."""
    tags = list(seen)
    lost = sorted(set(range(count)) - set(tags))
    dup = sorted({i for i in tags if tags.count(i) > 1}) if len(tags) != len(set(tags)) else []
    assert not lost and not dup, f"lost batches {lost[:20]}, duplicated batches {dup[:20]}"
    assert tags == list(range(count)), f"batches were reordered: {tags[:40]}"


def report_stall(record_property: Callable[[str, object], None], fault: str, result: EpochResult) -> None:
    """Print the longest stall and attach it to the test's JUnit record, so a CI log shows it."""
    line = (f"[fault] {fault}: {len(result.seen)} batches, longest stall {result.max_stall_s:.3f} s "
            f"(before batch {result.stall_before_batch})")
    print(line)
    record_property("fault", fault)
    record_property("max_stall_s", round(result.max_stall_s, 3))
    record_property("batches", len(result.seen))


class LoopThread:
    """An asyncio loop on a daemon thread: run coroutines from synchronous test code.

    Why: TcpProxy and the etcd client are asyncio objects that must live on one loop for their
    whole life, while DistillReader's training loop is plain synchronous code.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fault-loop")

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float = 30.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def registered(address: str, service: str) -> dict[str, str]:
    """instance id -> endpoint of the teachers registered under ``service`` right now."""
    async with open_registry(address) as reg:
        snap = await reg.teachers(service)
        return {iid: entry.record.endpoint for iid, entry in snap.items()}


def wait_until(check: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.1) -> float:
    """Poll ``check`` until true; the seconds it took, or AssertionError naming ``what``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not true within {timeout} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def stats_for(reader: DistillReader, service: str, endpoint: str) -> dict[str, Any]:
    """The reader's figures for one teacher (empty when it does not know the endpoint)."""
    return dict(reader.stats().teachers.get(service, {}).get(endpoint, {}))




Teacher = tuple[subprocess.Popen[bytes], dict[str, Any]]


def start_teachers(stack: contextlib.ExitStack, arg_lists: Sequence[Sequence[str]], tmp_path: Path,
                   env: dict[str, str] | None = None) -> list[Teacher]:
    """Start several ``teacher_process`` subprocesses at once (each pays torch's import time, so in
    parallel the suite stays within its budget); ``stack`` kills them all at the end. Each may take
    up to 60 s per process started with it to become ready: they share the machine's cores."""
    ready_s = 60.0 * len(arg_lists)

    def one(args: Sequence[str]) -> tuple[Any, Teacher]:
        cm = teacher_process(list(args), tmp_path, env=env, timeout=ready_s)
        return cm, cm.__enter__()

    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(one, args) for args in arg_lists]
        started: list[Teacher] = []
        errors: list[BaseException] = []
        for f in futures:
            try:
                cm, teacher = f.result(ready_s + 30)
            except BaseException as e:  # keep going: every started process must be registered for cleanup
                errors.append(e)
                continue
            stack.push(cm)
            started.append(teacher)
    if errors:
        raise errors[0]
    return started


class Respawner:
    """Restarts a teacher on the same port in the background while the training loop goes on.

    ``start()`` returns at once; ``ready`` is set when the new process serves. Every process it
    started is killed by ``close()`` (registered on the test's ExitStack).
    """

    def __init__(self, args: Sequence[str], tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.tmp_path = tmp_path
        self.env = env
        self.ready = threading.Event()
        self.current: Teacher | None = None
        self.error: BaseException | None = None
        self._cms: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        self.ready.clear()

        def run() -> None:
            try:
                cm = teacher_process(self.args, self.tmp_path, env=self.env)
                teacher = cm.__enter__()
                with self._lock:
                    self._cms.append(cm)
                self.current = teacher
            except BaseException as e:
                self.error = e
            finally:
                self.ready.set()

        t = threading.Thread(target=run, daemon=True, name="respawn")
        self._threads.append(t)
        t.start()

    def close(self) -> None:
        for t in self._threads:
            t.join(90)
        with self._lock:
            cms, self._cms = self._cms, []
        for cm in cms:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
