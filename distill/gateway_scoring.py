"""The gateway's scoring: vLLM-style prompts answered through the mesh by `DistillReader`s.

Each prompt is one batch of one sequence (`[1, T]` token ids) submitted to a reader built without
a loader (`reader.submit(batch)`, the on-policy API), so every prompt of every body goes through
the reader's routing, per-chunk deadlines, ejection, failover and hedging on its own, and the
teachers' padded batchers regroup them by length with every other student's sequences. The
reader asks the teachers for the prompt's top-k log-probs and ids, its own tokens' log-probs and
ranks (`protos.vllm.scoring_parameters`), reduced on the teacher's device and carried in binary
KServe v2; `protos.vllm` turns them into vLLM's answer.

The wire top-k is the gateway's `max_logprobs` whatever a body asks (a body's `prompt_logprobs: k`
is a slice of it), and each prompt carries its body's `temperature` as a request parameter
(`reader.submit(batch, temperature=T)`; the teachers apply it per request), so one reader serves
every body at every temperature at once: one student record and one demand figure in the registry
(student id `<host-pid>-gateway`), and no reader is ever closed under a request while the gateway
serves. A gateway of several teachers has one `Scorer` (one reader, pool and demand) per teacher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distill.errors import BatchRejectedError, DistillError, InputRefusal, NonFiniteOutputError, NoTeacherError
from distill.options import ReaderOptions, default_student_id
from distill.reader import DistillReader
from protos.vllm import (
    MAX_PROMPT_LOGPROBS,
    APIError,
    Scored,
    outputs_not_finite,
    prompt_too_long,
    token_out_of_vocabulary,
)

__all__ = ["READER_FLAGS", "Scorer", "ScoringSettings"]

log = logging.getLogger("distill.gateway")

READER_FLAGS = {"model": "--model", "timeout": "--timeout", "no_teacher_timeout": "--no-teacher-timeout"}
"""The gateway's flag (`distill.gateway_cli`) for each reader option it sets: the gateway's reader
names these where a message says which setting fixes it (`ReaderOptions.flag_names`), not the
reader's own --distill_* flags."""

RETRY_START_S = 1.0
"""Pause between attempts to start a reader while no teacher is there yet."""


@dataclass(frozen=True)
class ScoringSettings:
    """Where the teachers are and how prompts reach them (the reader's options, less the transforms)."""

    teachers: str | None = None
    registry: str | None = None
    service: str | None = None
    registry_options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    input_name: str = "INPUT_IDS"
    output_name: str = "LOGITS"
    max_logprobs: int = MAX_PROMPT_LOGPROBS
    timeout: float = 30.0
    no_teacher_timeout: float = 30.0
    hedge_after: float | str | None = "auto"
    max_in_flight: int = 64
    student_id: str = ""

    def reader_options(self) -> ReaderOptions:
        """The options of the reader serving every body (validated by ReaderOptions); temperature 1
        is stated, and a body at another sends its own with each prompt."""
        return ReaderOptions(
            inputs=[self.input_name], outputs=[self.output_name], teachers=self.teachers, registry=self.registry,
            service=self.service, registry_options=self.registry_options, model=self.model, timeout=self.timeout,
            no_teacher_timeout=self.no_teacher_timeout, hedge_after=self.hedge_after, ordered=False,
            prefetch=self.max_in_flight,
            top_k=self.max_logprobs, logprobs=True, temperature=1.0, topk_tail=False, output_dtype="FP32",
            token_logprobs=True, token_ranks=True, flag_names=READER_FLAGS,
            student_id=f"{self.student_id or default_student_id()}-gateway")


class Scorer:
    """Owns the reader; `score` answers prompts, `ready` says whether a teacher is usable. Lives on
    the gateway's event loop; every blocking reader call runs on a worker thread. The reader is
    replaced only once its engine gave up (no teacher for `no_teacher_timeout`), which has failed
    everything in flight on it already, and closed only then or by `close()`."""

    def __init__(self, settings: ScoringSettings) -> None:
        self.settings = settings
        self._reader: DistillReader | None = None
        self._starting: asyncio.Task[DistillReader] | None = None
        self._window = asyncio.Semaphore(settings.max_in_flight)
        self._closed = False
        self._ready_checked = 0.0
        self._ready = False
        self._fingerprint = ""

    async def start(self) -> None:
        """Start the reader in the background: /health turns 200 once it has a teacher."""
        self._reader_task()

    def _reader_task(self) -> asyncio.Task[DistillReader]:
        task = self._starting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.get_running_loop().create_task(self._start_reader(), name="gateway-reader")
            task.add_done_callback(_log_failure)
            self._starting = task
        return task

    async def _start_reader(self) -> DistillReader:
        """A started reader; retried while no teacher or no registry is there (the gateway may start
        before the teachers do). A setup error (wrong model name, access refused) is not retried."""
        options = self.settings.reader_options()
        while True:
            reader = DistillReader(None, options)  # no loader: prompts come through submit()
            try:
                await _started(reader)
            except NoTeacherError as e:
                log.info("gateway: no teacher yet (%s); trying again", str(e).split(";")[0])
                await asyncio.to_thread(reader.close)
                await asyncio.sleep(RETRY_START_S)
                continue
            except OSError as e:  # the registry is not reachable yet
                log.info("gateway: registry not reachable yet (%s); trying again", e)
                await asyncio.to_thread(reader.close)
                await asyncio.sleep(RETRY_START_S)
                continue
            except BaseException:
                await asyncio.to_thread(reader.close)
                raise
            if self._closed:
                await asyncio.to_thread(reader.close)
                raise asyncio.CancelledError
            self._reader = reader
            return reader

    async def _current(self) -> DistillReader:
        if self._reader is not None:
            return self._reader
        try:
            return await asyncio.wait_for(asyncio.shield(self._reader_task()), self.settings.no_teacher_timeout)
        except TimeoutError:
            raise APIError(503, f"no teacher is usable (waited {self.settings.no_teacher_timeout:g} s): "
                                f"{self._where()}; retry once teachers are up") from None
        except DistillError as e:  # a setup error (model name, access): said as is, tried again next time
            raise APIError(503, f"the gateway cannot use the teachers: {e}") from None

    def _where(self) -> str:
        s = self.settings
        return f"service {s.service!r} in {s.registry}" if s.registry else f"teachers {s.teachers}"

    async def ready(self) -> bool:
        """Whether the reader has a usable teacher now (checked at most every 0.2 s)."""
        await self._check()
        return self._ready

    async def fingerprint(self) -> str:
        """The fingerprint of the teachers that answer: the one the reader pinned for its service
        (`distill.fingerprints`: it sends to no replica of another), "" while it knows none."""
        await self._check()
        return self._fingerprint

    async def _check(self) -> None:
        now = time.monotonic()
        if now - self._ready_checked < 0.2:
            return
        reader = self._reader
        if reader is None and not self._closed:
            self._reader_task()  # the reader was dropped (its teachers went away): look for them again
        stats = None if reader is None else await asyncio.to_thread(reader.stats)
        pinned = [] if stats is None else [str(f.get("pinned") or "") for f in stats.fingerprints.values()]
        self._ready = stats is not None and stats.teachers_in_use > 0
        self._fingerprint = pinned[0] if len(pinned) == 1 else ""
        self._ready_checked = time.monotonic()

    async def score(self, prompts: Sequence[Sequence[int]], temperature: float) -> list[Scored]:
        """Every prompt's reduced outputs, through the mesh; APIError with the status to answer."""
        reader = await self._current()
        tasks = [asyncio.ensure_future(self._one(reader, temperature, i, ids)) for i, ids in enumerate(prompts)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # the first refusal answers the body (or the caller left): the other prompts are dropped
            for task in tasks:
                task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task in done and (error := task.exception()) is not None:
                for other in done:  # retrieved, so none is logged as never retrieved
                    other.exception()
                raise error
        return [task.result() for task in tasks]

    async def _one(self, reader: DistillReader, temperature: float, index: int, ids: Sequence[int]) -> Scored:
        batch = {self.settings.input_name: np.asarray([ids], dtype=np.int64)}
        async with self._window:
            try:
                outputs = await asyncio.wrap_future(reader.submit(batch, temperature=temperature))
            except NonFiniteOutputError:  # the reader's default, nonfinite="error": one row, this prompt
                raise outputs_not_finite([index]) from None
            except BatchRejectedError as e:
                raise refused(index, e, self.settings.input_name) from None
            except NoTeacherError as e:
                self._drop(reader)
                raise APIError(503, f"no teacher is usable: {e}") from None
            except TimeoutError:
                raise APIError(503, "no teacher answered this prompt within the gateway's deadline (--timeout, "
                                    "--no-teacher-timeout); retry") from None
            except DistillError as e:  # the reader's engine gave up under the request, or the gateway is stopping
                self._drop(reader)
                raise APIError(503, f"scoring failed: {e}; retry") from None
        name = self.settings.output_name

        def get(suffix: str) -> np.ndarray:  # the row taken by numpy: a torch op would hand the GIL round
            return np.asarray(outputs[name + suffix].numpy()[0])

        return Scored(get("_TOPK_VALUES"), get("_TOPK_INDICES"), get("_TOKEN_LOGPROBS"), get("_TOKEN_RANKS"))

    def _drop(self, reader: DistillReader) -> None:
        """A reader whose engine gave up (no teacher for its timeout; that failed everything in flight
        on it) is replaced on the next body."""
        if self._reader is reader:
            self._reader = None
            self._starting = None
            asyncio.get_running_loop().run_in_executor(None, reader.close)

    async def close(self) -> None:
        """Stop starting the reader and close it (off the event loop)."""
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        reader, self._reader = self._reader, None
        if reader is not None:
            await asyncio.to_thread(reader.close)


def refused(index: int, error: BatchRejectedError, input_name: str) -> APIError:
    """The 400 for prompt `index` of a body (its place in `prompt`) that the teachers refused, said of
    the HTTP request, from the refusal's facts: a token id out of the vocabulary at a position of
    that prompt, or a prompt past the context. Without facts (a teacher that sends none), the
    teachers' own words. Each prompt is a batch of one row, so a position is the index's last."""
    r: InputRefusal | None = error.refusal
    if r is not None and r.input == input_name:
        if r.kind in ("vocabulary", "classes") and len(r.index) == 2:
            return token_out_of_vocabulary(index, r.value, r.index[1], r.limit)
        if r.kind == "context":
            return prompt_too_long(index, r.value, r.limit)
    return APIError(400, f"prompt {index}: {error.reason}", "prompt")


async def _started(reader: DistillReader) -> None:
    """`reader.start()` on a worker thread. Cancelled meanwhile, it waits for the start to end (a
    thread cannot be interrupted) and closes the reader, so no engine thread outlives the gateway."""
    start = asyncio.ensure_future(asyncio.to_thread(reader.start))
    try:
        await asyncio.shield(start)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await start
        await asyncio.to_thread(reader.close)
        raise


def _log_failure(task: asyncio.Task[DistillReader]) -> None:
    """A reader that cannot start for a reason waiting does not fix (a model name no teacher serves,
    access refused) is said at once; requests get the same error as a 503."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("gateway: the reader does not start: %s", error)
