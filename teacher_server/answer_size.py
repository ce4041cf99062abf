"""The size of a request's answer, known from the request before any work: refuse what cannot be sent.

An answer larger than one message (--max-message-mb: gRPC's send limit, and the bound on an HTTP
answer's tensors) can never reach its client, however long the model computes it: a full LOGITS
of a 152k vocabulary over 4,096 positions is 2.5 GB. So each validated request's answer is sized
from the model's declared outputs and the request's transforms, and refused on arrival with
INVALID_ARGUMENT (HTTP 400) naming its size, the limit and how to ask for less, before it is
queued: nobody else waits on it and the model never runs it.

The tensors' bytes are exact: each output the request gets (`answer_tensors`) with the shape and
datatype `teacher_server.outputs.transform_output` gives it: the full tensor unless an active
transform reduces it, and each output an active transform adds with the shape and datatype its
declaration in `protos.outputs` says (`_TOPK_VALUES` `[.., k]`, `_TOKEN_LOGPROBS` `[..]`,
`_SCORED_LOGPROBS` `[.., m]`, ...), in the dtypes `transform_rows.derived_dtype` gives, which are
the ones its `apply` sends them in. The framing around them is a margin (`FRAME_BYTES` per
answer, `FRAME_BYTES_PER_OUTPUT` per output and `FRAME_BYTES_PER_DIM` per dimension of its
shape), above what gRPC's protobuf fields or the HTTP answer's JSON header (for binary outputs)
take. Outputs sent as JSON `data` over HTTP are counted at their binary size too.

A dimension the model chooses itself (a -1 that is not a padded model's positions) counts as 1: for
those the size is a lower bound, and the answer, once computed, is checked again before it is sent
(`check_answer_sent`), so it is refused with the same words rather than failing in the transport.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos.kserve import datatype, datatype_of
from protos.outputs import SCORE_IDS
from teacher_server.errors import InvalidRequestError
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO, TensorSpec
from teacher_server.transform_rows import derived_dtype, value_dtype
from teacher_server.transforms import OutputTransform, Transform, scoreable
from teacher_server.work import Work

__all__ = ["FRAME_BYTES", "FRAME_BYTES_PER_DIM", "FRAME_BYTES_PER_OUTPUT", "AnswerTensor", "answer_bytes",
           "answer_tensors", "check_answer_sent", "check_answer_size"]

FRAME_BYTES = 512
"""Margin for what an answer carries besides its outputs, plus its model name, version and id."""
FRAME_BYTES_PER_OUTPUT = 128
"""Margin for each output's own fields, plus its name (HTTP's JSON header entry of a binary output,
``{"name":..,"datatype":..,"shape":[..],"parameters":{"binary_data_size":N}}``, is the larger)."""
FRAME_BYTES_PER_DIM = 21
"""Margin for each dimension of an output's shape (a 20-digit number and its separator)."""

MiB = 1 << 20
_SHOWN = 3  # outputs named in a refusal, the largest first


@dataclass(frozen=True, slots=True)
class AnswerTensor:
    """One output of an answer: its name, datatype and shape (batch dimension first)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * datatype(self.datatype).itemsize


@dataclass(frozen=True, slots=True)
class _Output:
    """What one wanted output's transforms see: whether it is floating, and the dtype its values are
    computed in."""

    want: OutputTransform
    spec: TensorSpec
    floating: bool
    computed: torch.dtype

    def values(self) -> torch.dtype:
        """The dtype values taken from the output itself are sent as (`transform_rows.value_dtype`)."""
        return value_dtype(self.want, self.spec.datatype, self.floating) or self.computed


def _per_sample(spec: TensorSpec, length: int | None) -> tuple[int, ...]:
    """The output's shape for one sample of this request: a per-position output's -1 is the
    request's length; any other -1 (chosen by the model) counts as 1."""
    return tuple((length if spec.per_position and length is not None else 1) if d == -1 else d for d in spec.shape)


@dataclass(frozen=True, slots=True)
class _Layout:
    """The tensors one wanted output becomes, each as (name, datatype, dimensions after the
    output's rows of positions), what they take a row, and their framing margin."""

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    row_bytes: int
    frame: int


@functools.lru_cache(maxsize=1024)
def _layout(want: OutputTransform, spec: TensorSpec, active: tuple[Transform, ...], classes: int,
            widths: tuple[tuple[str, int], ...]) -> _Layout:
    """`outputs.transform_output`'s names, shapes and dtypes for `want` of `spec` when the
    registry entries `active` run, each derived output's by its declaration (`protos.outputs`);
    `widths`: the last dimension of each auxiliary input sent (cached: requests repeat a few kinds
    of wants)."""
    floating = spec.datatype in FLOAT_OUTPUT_DTYPES or spec.datatype == "FP64"
    fp32 = floating and any(t.floating for t in active)
    o = _Output(want, spec, floating, torch.float32 if fp32 else spec.torch_dtype)
    parameters, sent = want.parameters, dict(widths)
    emitted = [(d.name(spec.name), derived_dtype(d, want, spec.datatype, floating) or o.computed,
                tuple(max(n, 1) for n in d.last.trailing(classes, parameters, sent)))
               for t in active if t.apply is not None for d in t.outputs if floating or not d.floating_only]
    if not any(t.reduces for t in active):
        emitted.insert(0, (spec.name, o.values() if floating else spec.torch_dtype, (classes,) if spec.shape else ()))
    rank = max(len(spec.shape), 1)  # the batch and the positions: the dimensions before `trailing`
    tensors = tuple((name, datatype_of(dtype).name, trailing) for name, dtype, trailing in emitted)
    return _Layout(tensors,
                   sum(math.prod(trailing) * datatype_of(dtype).itemsize for _, dtype, trailing in emitted),
                   sum(FRAME_BYTES_PER_OUTPUT + len(name) + FRAME_BYTES_PER_DIM * (rank + len(trailing))
                       for name, _, trailing in tensors))


def _layouts(work: Work, io: ModelIO) -> list[tuple[_Layout, tuple[int, ...]]]:
    """Each wanted output's layout and its rows of positions (the batch, then the positions)."""
    widths = tuple(sorted((name, int(t.shape[-1])) for name, t in work.aux.items() if t.dim() == 3))
    m = dict(widths).get(SCORE_IDS.name, 0)
    out = []
    for want in work.outputs:
        spec = io.output(want.name)
        if spec is None:
            continue
        per_sample = _per_sample(spec, work.length)
        active = tuple(want.active(m > 0 and scoreable(spec)))
        layout = _layout(want, spec, active, per_sample[-1] if per_sample else 1, widths)
        out.append((layout, (work.batch_size, *per_sample[:-1])))
    return out


def answer_tensors(work: Work, io: ModelIO) -> list[AnswerTensor]:
    """Every tensor the answer to `work` (a validated request) carries, in the order it is sent."""
    return [AnswerTensor(name, datatype, (*rows, *trailing))
            for layout, rows in _layouts(work, io) for name, datatype, trailing in layout.tensors]


def answer_bytes(tensors: list[AnswerTensor], names: int = 0) -> int:
    """The bytes of an answer of `tensors`: theirs exactly, plus the framing margins; `names`: the
    characters of the model name, version and request id it repeats."""
    frames = sum(FRAME_BYTES_PER_OUTPUT + len(t.name) + FRAME_BYTES_PER_DIM * len(t.shape) for t in tensors)
    return sum(t.nbytes for t in tensors) + FRAME_BYTES + names + frames


def check_answer_size(work: Work, io: ModelIO, limit: int, names: int = 0) -> None:
    """InvalidRequestError when the answer to `work` would exceed `limit` bytes, naming its size,
    its largest outputs, the limit and what to change; nothing otherwise. `answer_bytes` of
    `answer_tensors`, summed here without building them, as this runs for every request."""
    layouts = _layouts(work, io)
    size = FRAME_BYTES + names + sum(math.prod(rows) * layout.row_bytes + layout.frame for layout, rows in layouts)
    if size > limit:
        _refuse_over(answer_tensors(work, io), limit, names, "so it is not computed")


def check_answer_sent(outputs: Sequence[EncodedOutput], limit: int, names: int = 0) -> None:
    """The same bound on an answer computed already, before a front end tries to send it: only an
    answer whose size on arrival was a lower bound (a dimension the model chooses) can fail here,
    and it then fails as the same refusal instead of as the transport's error."""
    _refuse_over([AnswerTensor(name, dt, tuple(shape)) for name, dt, shape, _ in outputs], limit, names,
                 "so it cannot be sent")


def _refuse_over(tensors: list[AnswerTensor], limit: int, names: int, consequence: str) -> None:
    size = answer_bytes(tensors, names)
    if size <= limit:
        return
    largest = sorted(tensors, key=lambda t: t.nbytes, reverse=True)[:_SHOWN]
    shown = ", ".join(f"{t.name} {list(t.shape)} {t.datatype} {t.nbytes:,} bytes" for t in largest)
    flag = f" (--max-message-mb {limit / MiB:g})" if limit % MiB == 0 else ""
    raise InvalidRequestError(
        f"the answer would be {size:,} bytes ({shown}), over the teacher's limit of {limit:,} bytes a "
        f"message{flag}, {consequence}; ask for less: the top_k parameter (the k largest values and their "
        "indices per position instead of every class), output_dtype FP16 or BF16 (half the bytes of floating "
        "outputs), fewer positions (shorter sequences) or fewer rows per request; or raise --max-message-mb on "
        "the teacher (and the client's receive limit)")
