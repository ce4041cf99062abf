"""Turning a received `InferRequest` into `Work` for the batcher, or a precise refusal.

Every check happens before a request is queued, so a bad request costs its sender a clear
`InvalidRequestError` (INVALID_ARGUMENT) and costs everyone else nothing. Raw input bytes are
wrapped, not copied.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from protos.kserve import DATATYPES, decode_tensor, decode_values, shape_numel
from teacher_server.errors import InvalidRequestError, echo
from teacher_server.infer_request import InferRequest, Parameters
from teacher_server.near_miss import near_miss
from teacher_server.spec import ModelIO, TensorSpec
from teacher_server.transforms import (
    AUX_INPUTS,
    PARAMETERS,
    REGISTRY,
    OutputDefaults,
    OutputTransform,
    scoreable,
    token_input,
)
from teacher_server.work import PadPlan, Work

log = logging.getLogger(__name__)

# Names of ignored parameters already logged; bounded, since clients choose the names.
_IGNORED_LOGGED: set[str] = set()
_MAX_IGNORED_LOGGED = 1024


def _ignore(key: str, where: str) -> None:
    """A parameter this server does not use (Triton clients send several, e.g. sequence_id,
    binary_data_output, triton_enable_empty_final_response): accepted and ignored, as Triton does;
    logged once per name at DEBUG."""
    if key in _IGNORED_LOGGED or len(_IGNORED_LOGGED) >= _MAX_IGNORED_LOGGED:
        return
    _IGNORED_LOGGED.add(key)
    log.debug("ignoring %s parameter %s (not used by teacher-server)", where, echo(key))


def _non_negative_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _output_options(params: Parameters, where: str, base: OutputTransform, request_level: bool,
                    asked: set[str]) -> OutputTransform:
    """`base` with the transform parameters in `params` applied (each checked by its registry
    entry); `asked` collects the names set. Scheduling parameters are checked at request level."""
    changes: dict[str, object] = {}
    misses: list[str] = []
    for key, value in params.items():
        param = PARAMETERS.get(key)
        if param is not None:
            try:
                changes[key] = param.check(value)
            except ValueError as e:
                raise InvalidRequestError(f"{where}: {e}") from None
            asked.add(key)
        elif key == "priority" and request_level:
            if not _non_negative_int(value):
                raise InvalidRequestError(
                    f"{where}: priority must be a non-negative integer (uint64_param or int64_param; "
                    f"0 is the default priority), got {echo(value)}")
        elif key == "timeout" and request_level:
            if not _non_negative_int(value):
                raise InvalidRequestError(
                    f"{where}: timeout must be a non-negative integer of microseconds (int64_param; "
                    f"0 means none), got {echo(value)}")
        elif key == "classification":
            raise InvalidRequestError(f"{where}: 'classification' outputs are not served; ask for top_k instead")
        elif (meant := near_miss(key)) is not None:
            misses.append(f"{echo(key)} (did you mean {meant!r}?)")
        else:
            _ignore(key, where.split(" ", 1)[0])
    if misses:
        raise InvalidRequestError(
            f"{where}: unknown parameter{'s' if len(misses) > 1 else ''} {', '.join(sorted(misses))}; parameters "
            "teacher-server does not use are ignored, as Triton does, but near-misses of its own are refused so "
            "that a typo cannot silently change the answer")
    return base.replace(**changes) if changes else base


def _uses_shared_memory(req: InferRequest) -> bool:
    return any(k.startswith("shared_memory") for t in req.inputs for k in t.parameters) or any(
        k.startswith("shared_memory") for t in req.outputs for k in t.parameters
    )


def validate(req: InferRequest, io: ModelIO, max_batch_size: int, defaults: OutputDefaults) -> Work:
    """Check one request against the model and decode its inputs; raise InvalidRequestError naming
    the first problem found."""
    if _uses_shared_memory(req):
        raise InvalidRequestError("shared-memory tensors are not supported; send raw_input_contents")
    raws = req.raw_inputs
    if raws and len(raws) != len(req.inputs):
        raise InvalidRequestError(
            f"{len(raws)} raw_input_contents for {len(req.inputs)} inputs; "
            "send one raw buffer per input, in the same order"
        )
    seen: dict[str, torch.Tensor] = {}
    aux: dict[str, torch.Tensor] = {}
    batch: int | None = None
    for i, t in enumerate(req.inputs):
        spec = io.input(t.name)
        if spec is None and t.name in AUX_INPUTS:
            spec = TensorSpec(t.name, AUX_INPUTS[t.name].datatype, (-1, -1))
        if spec is None:
            raise InvalidRequestError(
                f"unknown input {echo(t.name)}; the model's inputs are {[s.name for s in io.inputs]}")
        if t.name in seen or t.name in aux:
            raise InvalidRequestError(f"input {t.name!r} appears twice")
        if t.datatype != spec.datatype:
            raise InvalidRequestError(
                f"input {t.name!r}: datatype {echo(t.datatype)} received, the model expects {spec.datatype!r}")
        expected = [-1, *spec.shape]
        if len(t.shape) != len(expected):  # before list(): a shape may arrive with millions of dims
            raise InvalidRequestError(
                f"input {t.name!r}: shape {_shape_text(t.shape)} received, the model expects {expected}")
        shape = list(t.shape)
        if any(d < 0 for d in shape) or not spec.matches(shape[1:]):
            raise InvalidRequestError(f"input {t.name!r}: shape {shape} received, the model expects {expected}")
        n = shape[0]
        if n < 1:
            raise InvalidRequestError(f"input {t.name!r}: batch size must be at least 1, got {n}")
        if n > max_batch_size:
            raise InvalidRequestError(
                f"input {t.name!r}: batch size {n} exceeds the model's max_batch_size {max_batch_size}")
        if batch is not None and n != batch:
            raise InvalidRequestError(f"input {t.name!r}: batch size {n} differs from the other inputs' {batch}")
        batch = n
        dt = DATATYPES[spec.datatype]
        into = seen if io.input(t.name) is not None else aux
        if raws:
            buf = raws[i]
            want = shape_numel(shape) * dt.itemsize
            if len(buf) != want:
                raise InvalidRequestError(
                    f"input {t.name!r}: {len(buf)} bytes received, shape {shape} of {spec.datatype} needs {want}"
                )
            into[t.name] = decode_tensor(buf, dt, shape)
        else:
            try:
                into[t.name] = decode_values(t.values, dt, shape)
            except ValueError as e:
                raise InvalidRequestError(f"input {t.name!r}: {e}") from None
    missing = [s.name for s in io.inputs if s.name not in seen and s.name != io.attention_mask]
    if missing:
        raise InvalidRequestError(f"missing inputs {missing}; the model's inputs are {[s.name for s in io.inputs]}")
    assert batch is not None
    check_limits(seen, io)
    wanted = _wanted_outputs(req, io, defaults, bool(aux))
    check_scoring(seen, aux, io, wanted)
    if not io.padded:
        key = tuple(tuple(seen[s.name].shape[1:]) for s in io.inputs if -1 in s.shape)
        return Work([seen[s.name] for s in io.inputs], batch, wanted, key, aux=aux)
    work = _padded_work(seen, batch, io, wanted)
    work.aux = aux
    return work


def _padded_work(seen: dict[str, torch.Tensor], batch: int, io: ModelIO, wanted: list[OutputTransform]) -> Work:
    """A padded model's request: its sequence inputs agree on one length, and the attention mask
    (all ones) is built when the client sent none."""
    length: int | None = None
    first = ""
    for s in io.inputs:
        axis = s.seq_axis
        if axis is None or s.name not in seen:
            continue
        n = seen[s.name].shape[axis + 1]
        if length is None:
            length, first = n, s.name
        elif n != length:
            raise InvalidRequestError(
                f"input {s.name!r}: sequence length {n} differs from input {first!r}'s {length}; "
                "padded inputs and the attention mask must have one length per request")
    assert length is not None  # a padded model has a padded input, and none may be missing
    if io.attention_mask is not None and io.attention_mask not in seen:
        spec = io.input(io.attention_mask)
        assert spec is not None
        seen[spec.name] = torch.ones((batch, *[length if d == -1 else d for d in spec.shape]), dtype=spec.torch_dtype)
    key = tuple(tuple(seen[s.name].shape[1:]) for s in io.inputs if -1 in s.shape and s.seq_axis is None)
    return Work([seen[s.name] for s in io.inputs], batch, wanted, key, length, pad_plan(io))


def pad_plan(io: ModelIO) -> PadPlan:
    """Which inputs a batch pads: (sequence axis, pad value) for each padded input and the mask."""
    plan: list[tuple[int, float] | None] = []
    for i, s in enumerate(io.inputs):
        axis, value = s.seq_axis, io.input_pad(i)
        plan.append((axis, value) if axis is not None and value is not None else None)
    return tuple(plan)


def _shape_text(shape: Sequence[int]) -> str:
    if len(shape) <= 16:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:16]))}, ...] ({len(shape)} dimensions)"


def _wanted_outputs(req: InferRequest, io: ModelIO, defaults: OutputDefaults, aux: bool) -> list[OutputTransform]:
    """Each wanted output with its transforms: the server's defaults, then the request's
    parameters, then the output's own; each checked against the output by its registry entries."""
    request_asked: set[str] = set()
    base = _output_options(req.parameters, "request", defaults.transform(), True, request_asked)
    asked: dict[str, set[str]] = {}
    if req.outputs:
        wanted = []
        for o in req.outputs:
            spec = io.output(o.name)
            if spec is None:
                raise InvalidRequestError(
                    f"unknown output {echo(o.name)}; the model's outputs are {[s.name for s in io.outputs]}")
            if o.name in asked:
                raise InvalidRequestError(f"output {o.name!r} requested twice")
            asked[o.name] = set(request_asked)
            inherited = base.with_name(o.name)
            wanted.append(_output_options(o.parameters, f"output {o.name!r}", inherited, False, asked[o.name]))
    else:
        wanted = [base.with_name(s.name) for s in io.outputs]
    for w in wanted:
        spec = io.output(w.name)
        assert spec is not None
        set_here = frozenset(asked.get(w.name, request_asked))
        active = {id(t) for t in w.active(aux and scoreable(spec))}
        for transform in REGISTRY:
            if transform.check is None or (id(transform) not in active and not set_here & transform.names):
                continue
            problem = transform.check(w, spec, set_here)
            if problem:
                raise InvalidRequestError(problem)
    return wanted


def check_limits(seen: dict[str, torch.Tensor], io: ModelIO) -> None:
    """Token ids within the vocabulary and sequences within the context the model declares, so a
    bad request is refused here instead of failing the whole batch it would join."""
    for s in io.inputs:
        t = seen.get(s.name)
        if t is None:
            continue
        axis = s.seq_axis if s.seq_axis is not None else s.shape.index(-1) if -1 in s.shape else None
        if s.max_length is not None and axis is not None and t.shape[axis + 1] > s.max_length:
            length = int(t.shape[axis + 1])
            raise InvalidRequestError(
                f"input {s.name!r}: sequence length {length} exceeds the model's context of "
                f"{s.max_length} positions; send at most {s.max_length} tokens per sequence",
                {"kind": "context", "input": s.name, "value": length, "limit": s.max_length, "index": []})
        if s.max_value is not None:
            _check_ids(s.name, t, s.max_value, "vocabulary")


_ID_RANGES = {"vocabulary": "the vocabulary", "classes": "the scored output's classes"}


def _check_ids(name: str, t: torch.Tensor, limit: int, kind: str) -> None:
    """Every id of input `name` in 0..limit-1; `kind` names the range (`_ID_RANGES`), in the
    message and in the refusal's facts."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)  # one pass; this runs on the event loop, before the request is queued
    low, high = int(lo), int(hi)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        where = [int(i) for i in (t == bad).nonzero()[0]]
        raise InvalidRequestError(
            f"input {name!r}: id {bad} at {where} is outside {_ID_RANGES[kind]} of {limit} (ids must be in "
            f"0..{limit - 1})", {"kind": kind, "input": name, "value": bad, "limit": limit, "index": where})


def check_scoring(seen: dict[str, torch.Tensor], aux: dict[str, torch.Tensor], io: ModelIO,
                  wanted: list[OutputTransform]) -> None:
    """The scoring transforms' inputs fit the model: a token input to read next tokens from, and
    SCORE_IDS `[B, T, m]` with the request's length and ids that index the scored outputs."""
    scored = [io.output(w.name) for w in wanted if aux and scoreable(io.output(w.name))]  # type: ignore[arg-type]
    tokens = any(w.needs_tokens for w in wanted)
    if not scored and not tokens:
        if aux:
            raise InvalidRequestError(
                f"input SCORE_IDS: none of the wanted outputs {[w.name for w in wanted]} is a floating per-position "
                "output [T, V] to score; SCORE_IDS is for causal LMs (an hf: causal LM's LOGITS)")
        return
    index = token_input(io)
    if index is None or not io.padded:
        raise InvalidRequestError(
            "token_logprobs, token_ranks and SCORE_IDS need a model with a padded token input (an hf: causal LM, or "
            "--input IDS:INT64:-1:pad=0) and per-position outputs")
    ids = seen[io.inputs[index].name]
    if tokens:
        width = min(s.shape[-1] for s in (io.output(w.name) for w in wanted if w.needs_tokens) if s is not None)
        if width > 0:
            _check_ids(io.inputs[index].name, ids, width, "classes")
    for name, t in aux.items():
        if t.dim() != 3 or t.shape[1] != ids.shape[1] or t.shape[2] < 1:
            raise InvalidRequestError(
                f"input {name!r}: shape {list(t.shape)}; it must be [B, T, m] with T = {ids.shape[1]}, the request's "
                "sequence length (pad it like the ids), and m >= 1")
        width = min((s.shape[-1] for s in scored if s is not None), default=0)
        if width > 0:
            _check_ids(name, t, width, "classes")


