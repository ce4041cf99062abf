"""The outputs the teacher's transforms add to an answer, declared once for the teacher and the student.

A transform that changes values only (a temperature, log-softmax, a dtype) leaves an output's name
and shape alone. One that adds tensors adds each as a `DerivedOutput` of the output it reads,
named ``<OUT>`` + its suffix (``LOGITS_TOPK_VALUES``), which says
* its shape, relative to the base output's per-sample shape ``[.., C]`` (`LastDim`): the last
  dimension cut to a request parameter's value (top-k), dropped (one value per position), or as
  wide as an auxiliary input's last dimension (the m ids of ``SCORE_IDS``);
* its datatype: `VALUES` (the request's ``output_dtype``, else the base output's own), `PROBS`
  (the request's ``output_dtype``, else FP32), or a fixed KServe datatype (``INT32``);
* what activates it: request parameters that must all be set (``top_k``, ``topk_tail``), or an
  auxiliary input (`AuxInput`, an input the teacher reads besides its model's: ``SCORE_IDS``).

The teacher's transform registry (``teacher_server.transforms``) names these declarations as the
outputs of its entries and sizes answers from them (``teacher_server.answer_size``); the student
derives from them which outputs an answer must carry and their shapes (``distill.outputs``). A
transform registered from outside declares its outputs with `declare` (the teacher's ``register``
does it for its entries); a student in another process than the teacher calls `declare` with the
same objects. Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["DERIVED", "DROP_CLASSES", "INPUTS", "INPUT_DATATYPES", "PROBS", "SCORED_LOGPROBS", "SCORE_IDS",
           "TOKEN_LOGPROBS", "TOKEN_RANKS", "TOPK_INDICES", "TOPK_TAIL", "TOPK_VALUES", "VALUES", "AuxInput",
           "DerivedOutput", "LastDim", "declare", "derived_from", "flag_output", "last_from_input",
           "last_from_param", "undeclare"]

VALUES = "values"
"""Datatype rule: the request's output_dtype, else the base output's own (values taken from it)."""
PROBS = "probs"
"""Datatype rule: the request's output_dtype, else FP32 (probabilities derived from the values)."""


@dataclass(frozen=True)
class AuxInput:
    """An input a transform reads besides the model's own: never passed to forward(), and not in
    the teacher's metadata (a student sends it without the teacher declaring it)."""

    name: str
    datatype: str
    help: str


@dataclass(frozen=True)
class LastDim:
    """How a derived output's last dimension follows from its base output's ``[.., C]``: dropped
    (neither `param` nor `input`), the value of request parameter `param` (at most C), or the last
    dimension of auxiliary input `input`."""

    param: str | None = None
    input: str | None = None

    def trailing(self, classes: int, parameters: Mapping[str, object],
                 widths: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """The dimensions after the base output's positions; `classes`: C, -1 when unknown;
        `widths`: the auxiliary inputs' last dimensions (-1: unknown)."""
        if self.param is not None:
            n = int(parameters.get(self.param) or 0)  # type: ignore[call-overload]
            return (n if classes < 0 else min(n, classes),)
        if self.input is not None:
            return ((widths or {}).get(self.input, -1),)
        return ()


DROP_CLASSES = LastDim()
"""One value per position: the base output's class dimension is gone."""


def last_from_param(name: str) -> LastDim:
    """The last dimension is request parameter `name`'s value (top-k's k), at most the classes."""
    return LastDim(param=name)


def last_from_input(aux: AuxInput) -> LastDim:
    """The last dimension is as wide as auxiliary input `aux`'s (the m ids of SCORE_IDS)."""
    return LastDim(input=aux.name)


@dataclass(frozen=True)
class DerivedOutput:
    """One tensor a transform adds to each output it applies to (module docstring)."""

    suffix: str
    last: LastDim
    dtype: str  # VALUES, PROBS or a KServe datatype
    params: tuple[str, ...] = ()  # request parameters that must all be set for it to come
    input: AuxInput | None = None  # the auxiliary input whose presence makes it come
    floating_only: bool = False  # added to floating outputs only

    def name(self, base: str) -> str:
        return base + self.suffix

    def active(self, parameters: Mapping[str, object], inputs: Collection[str] = ()) -> bool:
        """Whether a request with `parameters` (wire names) sending auxiliary `inputs` gets it."""
        if not all(parameters.get(p) for p in self.params):
            return False
        return self.input is None or self.input.name in inputs

    def shape(self, base: tuple[int, ...], parameters: Mapping[str, object],
              widths: Mapping[str, int] | None = None) -> tuple[int, ...] | None:
        """Its per-sample shape from the base output's (-1: any size); None when the base output has
        no class dimension to derive it from."""
        if not base:
            return None
        return (*base[:-1], *self.last.trailing(base[-1], parameters, widths))

    def datatype(self, output_dtype: str | None, base_datatype: str) -> str:
        """Its KServe datatype, for a request asking `output_dtype` of a base output of `base_datatype`."""
        if self.dtype == VALUES:
            return output_dtype or base_datatype
        if self.dtype == PROBS:
            return output_dtype or "FP32"
        return self.dtype


def flag_output(name: str, last: LastDim, dtype: str) -> DerivedOutput:
    """The output `<OUT>_NAME` of the boolean request parameter `name` (token_logprobs:
    `<OUT>_TOKEN_LOGPROBS`, there when token_logprobs is true)."""
    return DerivedOutput("_" + name.upper(), last, dtype, (name,))


SCORE_IDS = AuxInput("SCORE_IDS", "INT32",
                     "[B, T, m] token ids, padded like the ids: adds <OUT>_SCORED_LOGPROBS, the log-probabilities "
                     "(after temperature) at those ids at each position")

TOPK_VALUES = DerivedOutput("_TOPK_VALUES", last_from_param("top_k"), VALUES, ("top_k",))
"""The k largest values per position, largest first."""
TOPK_INDICES = DerivedOutput("_TOPK_INDICES", last_from_param("top_k"), "INT32", ("top_k",))
"""The class ids of the top-k values."""
TOPK_TAIL = DerivedOutput("_TOPK_TAIL", DROP_CLASSES, PROBS, ("top_k", "topk_tail"), floating_only=True)
"""The probability mass outside the top-k per position."""
TOKEN_LOGPROBS = flag_output("token_logprobs", DROP_CLASSES, PROBS)
"""log p(x[t+1] | x[<=t]) at each position."""
TOKEN_RANKS = flag_output("token_ranks", DROP_CLASSES, "INT32")
"""The rank of each position's next token among the classes."""
SCORED_LOGPROBS = DerivedOutput("_SCORED_LOGPROBS", last_from_input(SCORE_IDS), PROBS, input=SCORE_IDS)
"""The log-probabilities at the ids of input SCORE_IDS."""

DERIVED: list[DerivedOutput] = [TOPK_VALUES, TOPK_INDICES, TOPK_TAIL, TOKEN_LOGPROBS, TOKEN_RANKS, SCORED_LOGPROBS]
"""Every declared output, in the order a teacher sends them (its transforms' order); `declare` adds."""

INPUTS: dict[str, AuxInput] = {SCORE_IDS.name: SCORE_IDS}
"""The auxiliary inputs of the declared outputs, by name (kept in place: other modules hold it)."""
INPUT_DATATYPES: dict[str, str] = {SCORE_IDS.name: SCORE_IDS.datatype}
"""Their wire datatypes, by name (kept in place too)."""


def declare(*outputs: DerivedOutput) -> None:
    """Add `outputs` after those declared; one declared already (the same object or an equal one)
    is left as it is. ValueError when another declaration has its suffix or its input's name."""
    for o in outputs:
        if not isinstance(o, DerivedOutput):
            raise TypeError(f"declare outputs as protos.outputs.DerivedOutput, got {o!r}")
        if o in DERIVED:
            continue
        if any(d.suffix == o.suffix for d in DERIVED):
            raise ValueError(f"an output with suffix {o.suffix!r} is declared already; choose another suffix")
        if o.input is not None and INPUTS.get(o.input.name, o.input) != o.input:
            raise ValueError(f"auxiliary input {o.input.name!r} is declared already with another datatype or help")
        DERIVED.append(o)
        if o.input is not None:
            INPUTS[o.input.name] = o.input
            INPUT_DATATYPES[o.input.name] = o.input.datatype


def undeclare(*outputs: DerivedOutput) -> None:
    """Remove `outputs` (added by `declare`; tests use it to clean up), and inputs no output reads."""
    DERIVED[:] = [d for d in DERIVED if d not in outputs]
    used = {d.input.name for d in DERIVED if d.input is not None}
    for name in [n for n in INPUTS if n not in used]:
        del INPUTS[name], INPUT_DATATYPES[name]


def derived_from(name: str) -> tuple[DerivedOutput, str] | None:
    """The declaration output `name` is an instance of and its base output's name (the longest
    matching suffix); None for a name no declared suffix ends."""
    found = max((d for d in DERIVED if len(name) > len(d.suffix) and name.endswith(d.suffix)),
                key=lambda d: len(d.suffix), default=None)
    return None if found is None else (found, name[: -len(found.suffix)])
