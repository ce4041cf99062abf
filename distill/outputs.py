"""Which outputs an answer carries and their per-sample shapes, given the transforms asked for.

A transform that changes values only (log-softmax, a temperature, a dtype) leaves the output's
name and shape alone. One that changes what comes back (top-k: ``<OUT>_TOPK_VALUES`` and
``<OUT>_TOPK_INDICES`` with the last dimension cut to k, and the optional ``<OUT>_TOPK_TAIL``
without it) is described here once, for the client that checks an answer
(``distill.teacher_client``) and the store that keeps it (``distill.cache.reader_side``).
The request parameters are read by their wire names (``ReaderOptions.request_parameters``).

Scoring given tokens (the wire contract is ``teacher_server.transforms``'): ``token_logprobs``
adds ``<OUT>_TOKEN_LOGPROBS`` (the declared shape without its class dimension), and a batch that
sends the auxiliary input ``SCORE_IDS`` (`AUX_INPUTS`: a teacher reads it without declaring it in
its metadata) gets ``<OUT>_SCORED_LOGPROBS`` (the class dimension cut to the m ids per position).
Top-k, token log-probs and scores each replace the full ``<OUT>``: it comes only when none is asked.
"""

from __future__ import annotations

from collections.abc import Mapping

from distill.types import ParameterValue, TensorMeta

__all__ = ["AUX_INPUTS", "SCORED", "TOKEN_LOGPROBS", "TOKEN_RANKS", "TOPK_PARTS", "VALID_ROWS", "base_output",
           "derived_names", "ids_output", "per_sample_shape", "wanted_outputs"]

TOPK = "_TOPK_"
TOPK_PARTS = ("VALUES", "INDICES", "TAIL")
"""The outputs top-k makes of one output: values, their class ids, and the mass outside them."""
TOKEN_LOGPROBS = "_TOKEN_LOGPROBS"
"""Suffix of the log-probability of each position's next token (request parameter token_logprobs)."""
TOKEN_RANKS = "_TOKEN_RANKS"
"""Suffix of the rank of each position's next token among the classes (request parameter token_ranks)."""
SCORED = "_SCORED_LOGPROBS"
"""Suffix of the log-probabilities at the ids of input SCORE_IDS."""
AUX_INPUTS = {"SCORE_IDS": "INT32"}
"""Inputs a teacher reads besides its model's (not in its metadata), with their wire datatype."""
VALID_ROWS = "VALID_ROWS"
"""The key of a batch's per-row validity mask (``[B]`` bool, False where a teacher's outputs hold
inf or NaN) among its teacher outputs, with ``nonfinite="mask"``: there only when some row is
invalid. ``KDLoss`` and ``TokenKDLoss`` take it as ``valid=``."""


def wanted_outputs(outputs: tuple[str, ...], parameters: Mapping[str, ParameterValue],
                   scored: bool = False) -> list[str]:
    """The output names an answer must carry: the outputs asked for, or with top-k their values and
    indices, and the tail mass when asked for (a tail a server sends by default, unasked, is dropped);
    with token_logprobs / token_ranks each output's token log-probs / ranks, and when the request sends SCORE_IDS
    (`scored`) its scored log-probs."""
    suffixes: list[str] = []
    if parameters.get("top_k"):
        parts = TOPK_PARTS if parameters.get("topk_tail") else TOPK_PARTS[:2]
        suffixes += [f"{TOPK}{part}" for part in parts]
    if parameters.get("token_logprobs"):
        suffixes.append(TOKEN_LOGPROBS)
    if parameters.get("token_ranks"):
        suffixes.append(TOKEN_RANKS)
    if scored:
        suffixes.append(SCORED)
    if not suffixes:
        return list(outputs)
    return [f"{n}{suffix}" for n in outputs for suffix in suffixes]


def per_sample_shape(name: str, declared: Mapping[str, TensorMeta],
                     parameters: Mapping[str, ParameterValue]) -> tuple[int, ...] | None:
    """The per-sample shape of answer output `name` (-1: any size), from the teacher's declared
    outputs; None if unknown. A top-k output keeps the declared shape with its last dimension cut
    to k; the tail mass has one value per position (the class dimension is gone)."""
    for suffix, last in ((TOKEN_LOGPROBS, ()), (TOKEN_RANKS, ()), (SCORED, (-1,))):
        if name.endswith(suffix):
            meta = declared.get(name[: -len(suffix)])
            return None if meta is None or not meta.shape else (*meta.shape[:-1], *last)
    k = parameters.get("top_k")
    if not k:
        meta = declared.get(name)
        return None if meta is None else meta.shape
    base, _, part = name.rpartition(TOPK)
    meta = declared.get(base)
    if meta is None or not meta.shape:
        return None
    if part == "TAIL":
        return tuple(meta.shape[:-1])
    return (*meta.shape[:-1], int(k))


def base_output(name: str) -> str:
    """The teacher output a (possibly transformed) output name comes from."""
    for suffix in (TOKEN_LOGPROBS, TOKEN_RANKS, SCORED):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    base, sep, part = name.rpartition(TOPK)
    return base if sep and part in TOPK_PARTS else name


def derived_names(name: str) -> tuple[str, ...]:
    """Every name output `name` may be stored under: itself, its top-k parts and its token scores."""
    return (name, *(f"{name}{TOPK}{part}" for part in TOPK_PARTS), f"{name}{TOKEN_LOGPROBS}",
            f"{name}{TOKEN_RANKS}", f"{name}{SCORED}")


def ids_output(name: str) -> str:
    """The name of the class ids of output `name` under top-k (itself when it already is one)."""
    suffix = f"{TOPK}INDICES"
    return name if name.endswith(suffix) else f"{name}{suffix}"


def is_ids_output(name: str) -> bool:
    return name.endswith(f"{TOPK}INDICES")
