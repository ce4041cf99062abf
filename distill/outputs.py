"""Which outputs an answer carries and their per-sample shapes, given the transforms asked for.

The outputs a transform adds are declared once, for the teacher and the student, in
``protos.outputs`` (suffix, shape relative to the output they come from, datatype, and the request
parameters or auxiliary input that bring them); everything here is derived from those declarations,
for the client that checks an answer (``distill.teacher_client``) and the store that keeps it
(``distill.cache.reader_side``). The request parameters are read by their wire names
(``ReaderOptions.request_parameters``). A transform that changes values only (log-softmax, a
temperature, a dtype) leaves an output's name and shape alone; one that adds outputs replaces the
full ``<OUT>`` when the teacher's registry says it reduces it, so the full output comes only when no
derived output is asked for. An output declared from outside (``protos.outputs.declare``) is
recognised here like the built-in ones.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from distill.types import ParameterValue, TensorMeta
from protos import outputs as declared_outputs
from protos.outputs import SCORED_LOGPROBS, TOPK_INDICES, TOPK_TAIL, TOPK_VALUES
from protos.text import TEXT_ONLY_OUTPUTS, VOCAB_PIECES

__all__ = ["AUX_INPUTS", "SCORED", "TOKEN_LOGPROBS", "TOKEN_RANKS", "TOPK_PARTS", "VALID_ROWS", "base_output",
           "default_outputs", "derived_names", "ids_output", "per_sample_shape", "register", "unregister",
           "wanted_outputs"]

_TOPK = "_TOPK_"
TOPK_PARTS = tuple(d.suffix.removeprefix(_TOPK) for d in (TOPK_VALUES, TOPK_INDICES, TOPK_TAIL))
"""The outputs top-k makes of one output: values, their class ids, and the mass outside them."""
TOKEN_LOGPROBS = declared_outputs.TOKEN_LOGPROBS.suffix
"""Suffix of the log-probability of each position's next token (request parameter token_logprobs)."""
TOKEN_RANKS = declared_outputs.TOKEN_RANKS.suffix
"""Suffix of the rank of each position's next token among the classes (request parameter token_ranks)."""
SCORED = SCORED_LOGPROBS.suffix
"""Suffix of the log-probabilities at the ids of input SCORE_IDS."""
AUX_INPUTS = declared_outputs.INPUT_DATATYPES
"""Inputs a teacher reads besides its model's (not in its metadata), with their wire datatype."""
VALID_ROWS = "VALID_ROWS"
"""The key of a batch's per-row validity mask (``[B]`` bool, False where a teacher's outputs hold
inf or NaN) among its teacher outputs, with ``nonfinite="mask"``: there only when some row is
invalid. ``KDLoss`` and ``TokenKDLoss`` take it as ``valid=``."""


def register(*outputs: declared_outputs.DerivedOutput) -> None:
    """Recognise the outputs of a transform registered on the teachers from outside the library: the
    same declarations the teachers' ``register`` was given (one call, in the student's process)."""
    declared_outputs.declare(*outputs)


def unregister(*outputs: declared_outputs.DerivedOutput) -> None:
    """Forget outputs given to `register` (tests use it to clean up)."""
    declared_outputs.undeclare(*outputs)


def wanted_outputs(outputs: tuple[str, ...], parameters: Mapping[str, ParameterValue],
                   scored: bool = False, inputs: Collection[str] = ()) -> list[str]:
    """The output names an answer must carry: the outputs asked for, or, when the parameters (and
    the auxiliary inputs sent: `scored` is SCORE_IDS) bring derived outputs, those of each output
    (top-k values and indices, the tail mass when asked for: a tail a server sends by default,
    unasked, is dropped; token log-probs, ranks, scored log-probs, ...)."""
    sent = {*inputs, *(("SCORE_IDS",) if scored else ())}
    suffixes = [d.suffix for d in declared_outputs.DERIVED if d.active(parameters, sent)]
    if not suffixes:
        return list(outputs)
    return [name for n in outputs  # a text request's own outputs (TEXT_IDS, ...) come as they are
            for name in ((n,) if n in TEXT_ONLY_OUTPUTS else (f"{n}{suffix}" for suffix in suffixes))]


def default_outputs(declared: Mapping[str, TensorMeta], text: bool) -> tuple[str, ...]:
    """The outputs asked of a teacher when the reader names none: every output it declares, but the
    text outputs (`protos.text`) only for a batch that sends texts, and never the vocabulary's."""
    return tuple(n for n in declared if n not in TEXT_ONLY_OUTPUTS or (text and n != VOCAB_PIECES))


def per_sample_shape(name: str, declared: Mapping[str, TensorMeta],
                     parameters: Mapping[str, ParameterValue]) -> tuple[int, ...] | None:
    """The per-sample shape of answer output `name` (-1: any size), from the teacher's declared
    outputs; None if unknown. A derived output's shape follows from its base output's by its
    declaration (top-k: the last dimension cut to k; tail, token log-probs and ranks: one value per
    position; scores: -1 ids per position)."""
    found = declared_outputs.derived_from(name)
    if found is not None and found[1] in declared:
        derived, base = found
        return derived.shape(declared[base].shape, parameters)
    meta = declared.get(name)
    return None if meta is None else meta.shape


def base_output(name: str) -> str:
    """The teacher output a (possibly transformed) output name comes from."""
    found = declared_outputs.derived_from(name)
    return name if found is None else found[1]


def derived_names(name: str) -> tuple[str, ...]:
    """Every name output `name` may be stored under: itself and each declared derived output of it."""
    return (name, *(d.name(name) for d in declared_outputs.DERIVED))


def ids_output(name: str) -> str:
    """The name of the class ids of output `name` under top-k (itself when it already is one)."""
    return name if is_ids_output(name) else TOPK_INDICES.name(name)


def is_ids_output(name: str) -> bool:
    return name.endswith(TOPK_INDICES.suffix)
