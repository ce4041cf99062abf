"""Turning a received `InferRequest` into `Work` for the batcher, or a precise refusal.

Every check happens before a request is queued, so a bad request costs its sender a clear
`InvalidRequestError` (INVALID_ARGUMENT) and costs everyone else nothing. Raw input bytes are
wrapped, not copied.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from protos.kserve import DATATYPES, decode_tensor, decode_values, shape_numel
from teacher_server.errors import InvalidRequestError, echo
from teacher_server.infer_request import InferRequest, Parameters
from teacher_server.outputs import OutputDefaults, OutputTransform
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO
from teacher_server.work import PadPlan, Work

REQUEST_PARAMETERS = ("output_dtype", "top_k", "logprobs", "temperature", "topk_tail", "priority", "timeout")
OUTPUT_PARAMETERS = ("output_dtype", "top_k", "logprobs", "temperature", "topk_tail")

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


def _output_options(params: Parameters, where: str, base: OutputTransform,
                    allowed: tuple[str, ...]) -> OutputTransform:
    dtype, top_k = base.datatype, base.top_k
    logprobs, temperature, topk_tail = base.logprobs, base.temperature, base.topk_tail
    for key, value in params.items():
        if key == "output_dtype":
            if not isinstance(value, str) or value.upper() not in FLOAT_OUTPUT_DTYPES:
                raise InvalidRequestError(
                    f"{where}: output_dtype must be one of {', '.join(FLOAT_OUTPUT_DTYPES)}, got {echo(value)}")
            dtype = value.upper()
        elif key == "top_k":
            if not _non_negative_int(value):
                raise InvalidRequestError(
                    f"{where}: top_k must be a non-negative integer (int64_param), got {echo(value)}")
            assert isinstance(value, int)
            top_k = value
        elif key in ("logprobs", "topk_tail"):
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{where}: {key} must be a boolean (bool_param), got {echo(value)}")
            if key == "logprobs":
                logprobs = value
            else:
                topk_tail = value
        elif key == "temperature":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise InvalidRequestError(
                    f"{where}: temperature must be a finite number > 0 (double_param), got {echo(value)}")
            temperature = float(value)
        elif key == "priority" and key in allowed:
            if not _non_negative_int(value):
                raise InvalidRequestError(
                    f"{where}: priority must be a non-negative integer (uint64_param or int64_param; "
                    f"0 is the default priority), got {echo(value)}")
        elif key == "timeout" and key in allowed:
            if not _non_negative_int(value):
                raise InvalidRequestError(
                    f"{where}: timeout must be a non-negative integer of microseconds (int64_param; "
                    f"0 means none), got {echo(value)}")
        elif key == "classification":
            raise InvalidRequestError(f"{where}: 'classification' outputs are not served; ask for top_k instead")
        else:
            _ignore(key, where.split(" ", 1)[0])
    return OutputTransform(base.name, dtype, top_k, logprobs, temperature, topk_tail)


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
    batch: int | None = None
    for i, t in enumerate(req.inputs):
        spec = io.input(t.name)
        if spec is None:
            raise InvalidRequestError(
                f"unknown input {echo(t.name)}; the model's inputs are {[s.name for s in io.inputs]}")
        if t.name in seen:
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
        if raws:
            buf = raws[i]
            want = shape_numel(shape) * dt.itemsize
            if len(buf) != want:
                raise InvalidRequestError(
                    f"input {t.name!r}: {len(buf)} bytes received, shape {shape} of {spec.datatype} needs {want}"
                )
            seen[t.name] = decode_tensor(buf, dt, shape)
        else:
            try:
                seen[t.name] = decode_values(t.values, dt, shape)
            except ValueError as e:
                raise InvalidRequestError(f"input {t.name!r}: {e}") from None
    missing = [s.name for s in io.inputs if s.name not in seen and s.name != io.attention_mask]
    if missing:
        raise InvalidRequestError(f"missing inputs {missing}; the model's inputs are {[s.name for s in io.inputs]}")
    assert batch is not None
    wanted = _wanted_outputs(req, io, defaults)
    if not io.padded:
        key = tuple(tuple(seen[s.name].shape[1:]) for s in io.inputs if -1 in s.shape)
        return Work([seen[s.name] for s in io.inputs], batch, wanted, key)
    return _padded_work(seen, batch, io, wanted)


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


def _asks_tail(req: InferRequest, name: str) -> bool:
    """The request itself (not the server's --topk-tail default) asks for output `name`'s tail."""
    if req.parameters.get("topk_tail") is True:
        return True
    return any(o.name == name and o.parameters.get("topk_tail") is True for o in req.outputs)


def _wanted_outputs(req: InferRequest, io: ModelIO, defaults: OutputDefaults) -> list[OutputTransform]:
    base = _output_options(req.parameters, "request", defaults.transform(), REQUEST_PARAMETERS)
    if req.outputs:
        wanted = []
        names = set()
        for o in req.outputs:
            spec = io.output(o.name)
            if spec is None:
                raise InvalidRequestError(
                    f"unknown output {echo(o.name)}; the model's outputs are {[s.name for s in io.outputs]}")
            if o.name in names:
                raise InvalidRequestError(f"output {o.name!r} requested twice")
            names.add(o.name)
            inherited = base.with_name(o.name)
            wanted.append(_output_options(o.parameters, f"output {o.name!r}", inherited, OUTPUT_PARAMETERS))
    else:
        wanted = [base.with_name(s.name) for s in io.outputs]
    for w in wanted:
        spec = io.output(w.name)
        assert spec is not None
        if w.top_k and not spec.shape:
            raise InvalidRequestError(f"output {w.name!r} has no class dimension; top_k needs one")
        if w.top_k and spec.shape[-1] != -1 and w.top_k > spec.shape[-1]:
            raise InvalidRequestError(
                f"output {w.name!r}: top_k {w.top_k} exceeds its last dimension {spec.shape[-1]}")
        floating = spec.datatype in FLOAT_OUTPUT_DTYPES or spec.datatype == "FP64"
        if w.logprobs and floating and not spec.shape:
            raise InvalidRequestError(f"output {w.name!r} has no class dimension; logprobs needs one")
        if w.topk_tail and not w.top_k and _asks_tail(req, w.name):
            raise InvalidRequestError(
                f"output {w.name!r}: topk_tail is the probability mass outside the top-k; ask for top_k too")
    return wanted
