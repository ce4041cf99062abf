"""Requests of a kind seen before, checked against a plan instead of validated from scratch.

Clients send one kind of request again and again: the same inputs (names, datatypes, per-sample
shapes), the same outputs, no parameters. All that `validation.validate` and
`answer_size.check_answer_size` decide about such a request, except its batch size and its byte
counts, depends only on its kind. So the first request of a kind is validated in full and leaves a
`RequestPlan`, and the next ones of that kind are checked against the plan (batch size within the
model's limit and equal across inputs, bytes matching the shape) and their raw bytes wrapped, as
`validate` wraps them. A request that fails those checks takes the full path, which refuses it with
its own message; so answers and refusals are exactly those of `validate`.

Plans apply only where validation reads nothing but the kind and the sizes: models without padded
inputs and without id or length limits (`TensorSpec.max_value`, `max_length`, which are checked
against each request's values), requests with raw inputs, no parameters at any level, and only the
model's own inputs (no text or scoring inputs). Everything else takes the full path every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protos.kserve import DATATYPES, Datatype, decode_tensor
from teacher_server.answer_size import check_answer_size
from teacher_server.infer_request import InferRequest
from teacher_server.outputs import OutputDefaults, OutputTransform
from teacher_server.spec import ModelIO
from teacher_server.validation import validate
from teacher_server.work import Work

MAX_PLANS = 64
"""Kinds remembered at once; clients choose the kinds (a -1 dimension can take any size), so past
this the plans are dropped and relearned."""

MAX_SIZES = 1024
"""Answer sizes (per batch size and name length) remembered per plan before they are dropped."""

_MAX_RANK = 16  # inputs with more dimensions than this are never planned (their key would be long)

Kind = tuple[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[str, ...]]
"""A request's inputs (name, datatype, per-sample shape) and wanted outputs, in request order."""


@dataclass(frozen=True)
class RequestPlan:
    """What a validated kind of request decodes to: for each model input in declaration order,
    the request's input index, its datatype, its per-sample shape and bytes per sample."""

    inputs: tuple[tuple[int, Datatype, tuple[int, ...], int], ...]
    wanted: tuple[OutputTransform, ...]
    shape_key: tuple[tuple[int, ...], ...]


class RequestPlans:
    """Validation of one served model's requests, by plan where their kind has one (module doc).

    Lives on the event loop (no locks). `max_answer_bytes` is the answer bound checked with
    `check_answer_size` (0: none)."""

    def __init__(self, io: ModelIO, max_batch_size: int, defaults: OutputDefaults, max_answer_bytes: int = 0) -> None:
        self._io = io
        self._max_batch = max_batch_size
        self._defaults = defaults
        self._limit = max_answer_bytes
        self._plannable = not io.padded and all(s.max_value is None and s.max_length is None for s in io.inputs)
        self._names = frozenset(s.name for s in io.inputs)
        self._plans: dict[Kind, RequestPlan] = {}
        self._sizes: dict[tuple[Kind, int, int], bool] = {}

    @property
    def plans(self) -> int:
        """Kinds of request planned now."""
        return len(self._plans)

    def validate(self, request: InferRequest, names: int = 0) -> Work:
        """`validation.validate` of `request`, then its answer size against the bound (`names`:
        the characters of model name, version and id the answer repeats); InvalidRequestError as
        they raise it."""
        kind = self._kind(request) if self._plannable else None
        plan = self._plans.get(kind) if kind is not None else None
        work = self._apply(plan, request) if plan is not None else None
        if work is None:
            work = validate(request, self._io, self._max_batch, self._defaults)
            if kind is not None and plan is None and not work.aux:
                self._learn(kind, request, work)
        if self._limit:
            self._check_size(kind, work, names)
        return work

    def _kind(self, request: InferRequest) -> Kind | None:
        raws = request.raw_inputs
        if request.parameters or not raws or len(raws) != len(request.inputs):
            return None
        inputs = []
        for t in request.inputs:
            if t.parameters or t.name not in self._names or not 1 <= len(t.shape) <= _MAX_RANK:
                return None
            inputs.append((t.name, t.datatype, tuple(t.shape[1:])))
        outputs = []
        for o in request.outputs:
            if o.parameters:
                return None
            outputs.append(o.name)
        return tuple(inputs), tuple(outputs)

    def _learn(self, kind: Kind, request: InferRequest, work: Work) -> None:
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
            self._sizes.clear()
        order = {t.name: i for i, t in enumerate(request.inputs)}
        inputs = []
        for s, x in zip(self._io.inputs, work.inputs, strict=True):
            dt = DATATYPES[s.datatype]
            sample = tuple(x.shape[1:])
            inputs.append((order[s.name], dt, sample, dt.itemsize * _numel(sample)))
        self._plans[kind] = RequestPlan(tuple(inputs), tuple(work.outputs), work.shape_key)

    def _apply(self, plan: RequestPlan, request: InferRequest) -> Work | None:
        """The request's Work by `plan`; None where the plan's checks fail (the full path says why)."""
        batch = 0
        tensors = []
        for i, dt, sample, row_bytes in plan.inputs:
            n = request.inputs[i].shape[0]
            raw = request.raw_inputs[i]
            if n < 1 or n > self._max_batch or (batch and n != batch) or len(raw) != n * row_bytes:
                return None
            batch = n
            tensors.append(decode_tensor(raw, dt, (n, *sample)))
        return Work(tensors, batch, list(plan.wanted), plan.shape_key)

    def _check_size(self, kind: Kind | None, work: Work, names: int) -> None:
        """`check_answer_size`, remembered per kind, batch size and name length: the answer's size
        depends on nothing else for a planned kind."""
        if kind is None or kind not in self._plans:
            check_answer_size(work, self._io, self._limit, names)
            return
        key = (kind, work.batch_size, names)
        if key in self._sizes:
            return
        check_answer_size(work, self._io, self._limit, names)  # raises when it does not fit: not remembered
        if len(self._sizes) >= MAX_SIZES:
            self._sizes.clear()
        self._sizes[key] = True


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
