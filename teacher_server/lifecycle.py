"""The life of one inference request, the same for every front end.

    admit  ->  validate  ->  answer size  ->  rows  ->  batcher queue  ->  model instance  ->  encoded outputs
    (model name/version, serving state)   (in-flight count, metrics and failure reasons throughout)

`text`: a request that sends TEXT (or VOCAB_IDS) becomes the ids request the rest of the path serves,
and its answer gains the text outputs (`teacher_server.text_requests`); the batcher sees only ids.

`rows`: a padded model's request whose attention mask marks padding is cut into its rows, each
back to its own length, so they batch with every other queued sequence; its answer is reassembled
at the request's padded width (`teacher_server.rows`).

A front end (gRPC in `grpc_service`, KServe v2 HTTP/REST in `http_service`) decodes what it received into an
`InferRequest`, awaits `RequestLifecycle.infer`, and turns the `InferResult` or the typed
`InferError` into its own response and status. The lifecycle never sees a protocol type. The
server drives it with three calls: `serve()` once the model is loaded, `begin_drain()` and
`wait_idle()`; front ends read `model` (static facts), `state`, `io` and `metrics`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import torch

from discovery.aio import bounded
from teacher_server.answer_size import check_answer_sent
from teacher_server.batcher import BatcherClosedError, BatchingConfig, DynamicBatcher, QueueFullError, Timing
from teacher_server.errors import (
    InferError,
    InvalidRequestError,
    ModelExecutionError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
)
from teacher_server.infer_request import InferRequest
from teacher_server.metrics import ServerMetrics
from teacher_server.outputs import EncodedOutput, OutputDefaults
from teacher_server.request_plans import RequestPlans
from teacher_server.rows import Rows, RowSplitter
from teacher_server.spec import ModelIO
from teacher_server.text_requests import TextPlan, TextRequests


class ServingState(enum.Enum):
    LOADING = "LOADING"  # the port answers, the model is not ready yet
    SERVING = "SERVING"
    DRAINING = "DRAINING"  # refusing new requests, finishing accepted ones


@dataclass(frozen=True)
class ServedModel:
    """The static facts every front end reports about the one model served (metadata, config)."""

    name: str
    version: str
    device: torch.device
    instances: int
    batching: BatchingConfig
    output_defaults: OutputDefaults = field(default_factory=OutputDefaults)
    source: str = ""  # what --model named (hf:DIR: where vllm_routes finds the tokenizer)
    # The largest answer a client can receive (--max-message-mb); a request whose answer would be
    # larger is refused before it is queued (`teacher_server.answer_size`). 0: no bound.
    max_answer_bytes: int = 0
    fingerprint: str = ""  # which model it computes with (teacher_server.fingerprint), once loaded
    text_prompts: bool = False  # it scores text with its tokenizer (teacher_server.text_requests), once loaded


@dataclass(frozen=True)
class InferResult:
    """A request's answer: its outputs, encoded, in the order the request asked for them, and its
    rows whose outputs hold a value that is not finite (inf, NaN): a front end says so in the
    answer (the response parameter `NONFINITE_ROWS_PARAMETER`), never sends them unannounced."""

    outputs: list[EncodedOutput]
    batch_size: int
    nonfinite_rows: tuple[int, ...] = ()


# Typed refusals to Triton's failure reasons in nv_inference_request_failure.
_FAILURE_REASON: dict[type[InferError], str] = {
    OverloadedError: "REJECTED",
    ModelExecutionError: "BACKEND",
}


class RequestLifecycle:
    """Admits, validates, schedules and accounts every inference request for one served model."""

    def __init__(self, model: ServedModel, metrics: ServerMetrics) -> None:
        self.model = model
        self.metrics = metrics
        self._state = ServingState.LOADING
        self._io: ModelIO | None = None
        self._batcher: DynamicBatcher | None = None
        self._rows: RowSplitter | None = None
        self._plans: RequestPlans | None = None
        self.text = TextRequests(model.source)  # its tokenizer is the vLLM routes' too
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- what the server drives -------------------------------------------------------------
    def serve(self, io: ModelIO, batcher: DynamicBatcher) -> None:
        """The model is loaded and its batcher runs: start admitting requests."""
        self._io = io
        self._batcher = batcher
        self._rows = RowSplitter(io) if RowSplitter.applies(io) else None
        self._plans = RequestPlans(io, self.model.batching.max_batch_size, self.model.output_defaults,
                                   self.model.max_answer_bytes)
        if self._state is ServingState.LOADING:
            self._state = ServingState.SERVING

    def begin_drain(self) -> None:
        """Refuse new requests from now on (UnavailableError); accepted ones go on."""
        self._state = ServingState.DRAINING

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if `timeout_s` ran out first."""
        if self._idle.is_set():  # a zero grace with nothing in flight has not run out
            return True
        try:
            await bounded(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    # ---- what front ends read ---------------------------------------------------------------
    @property
    def state(self) -> ServingState:
        return self._state

    @property
    def accepting(self) -> bool:
        return self._state is ServingState.SERVING

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet answered (queued, executing, or being validated)."""
        return self._in_flight

    @property
    def io(self) -> ModelIO:
        """The served model's tensors; UnavailableError while it loads."""
        if self._io is None:
            raise UnavailableError("the model is still loading; retry shortly")
        return self._io

    def check_model(self, name: str, version: str) -> None:
        """ModelNotFoundError unless `name` (and `version`, when given) is the served model."""
        m = self.model
        if name != m.name:
            raise ModelNotFoundError.unknown_model(name, m.name)
        if version not in ("", m.version):
            raise ModelNotFoundError.unknown_version(name, version, m.version)

    def _unavailable(self) -> UnavailableError:
        if self._state is ServingState.DRAINING:
            return UnavailableError("the teacher is draining (shutting down); retry on another teacher")
        return UnavailableError("the model is still loading; retry shortly")

    # ---- the request ------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResult:
        """Run one request to its outputs; raise an InferError subclass saying why not.

        Every outcome is counted once: success with its durations, or a failure under Triton's
        reason (REJECTED, BACKEND, CANCELED, OTHER). Cancellation (the caller went away)
        propagates unchanged.
        """
        start = time.perf_counter_ns()
        self._in_flight += 1
        self._idle.clear()
        try:
            outputs, timing, batch_size = await self._run(request)
        except InferError as e:
            self.metrics.record_failure(_FAILURE_REASON.get(type(e), "OTHER"))
            raise
        except asyncio.CancelledError:
            self.metrics.record_failure("CANCELED")
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        self.metrics.record_success(batch_size, time.perf_counter_ns() - start, timing.queue_ns, timing.compute_ns)
        if timing.nonfinite:
            self.metrics.record_nonfinite(len(timing.nonfinite))
        return InferResult(outputs, batch_size, timing.nonfinite)

    async def _run(self, request: InferRequest) -> tuple[list[EncodedOutput], Timing, int]:
        if request.malformed:
            raise InvalidRequestError(request.malformed)
        self.check_model(request.model_name, request.model_version)
        if (self._state is not ServingState.SERVING or self._io is None or self._batcher is None
                or self._plans is None):
            raise self._unavailable()
        text: TextPlan | None = None
        if TextRequests.applies(request, self._io):
            text = await self.text.prepare(request, self._io, self.model.batching.max_batch_size,
                                           self.model.max_answer_bytes)
            if text.request is None:
                return text.outputs, Timing(0, 0, text.batch_size), text.batch_size
            request = text.request
        names = len(self.model.name) + len(self.model.version) + len(request.id)
        work = self._plans.validate(request, names)  # validation and the answer's size, by plan where it can
        limit = self.model.max_answer_bytes
        split = self._rows.split(work) if self._rows is not None else work
        try:
            if isinstance(split, Rows):
                answers = await self._batcher.submit_rows(split.works)
                outputs = split.assemble([outs for outs, _ in answers])
                timing = Timing(max(t.queue_ns for _, t in answers), max(t.compute_ns for _, t in answers),
                                max(t.batch_size for _, t in answers),
                                split.request_rows([t.nonfinite for _, t in answers]))
            else:
                outputs, timing = await self._batcher.submit(work)
        except QueueFullError as e:
            raise OverloadedError(str(e)) from None
        except BatcherClosedError as e:
            raise UnavailableError(f"{e}; retry on another teacher") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise ModelExecutionError(f"model execution failed: {e}") from e
        if text is not None:
            outputs = text.answer(outputs)
        if limit:
            check_answer_sent(outputs, limit, names)
        return outputs, timing, work.batch_size
