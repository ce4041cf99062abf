"""A chunk's padded rows as an engine's prompts, and the engine's per-prompt answers as the tensors
a KServe teacher-server returns for the same request.

Engines take one token-id list per prompt and report log-probabilities per position; they never
see padding. So each row is cut to its attention mask, from its first marked position to its last
(as `teacher_server.rows` does: right, left and both-sided padding are cut, zeros inside a row
stay), and the answer is put back at the request's padded width with zeros at the padding.

The position convention is the teacher-server's: position t holds the distribution that predicts
token t + 1 (after `temperature`, log-softmax), so a row's last position holds the distribution of
the token after the row, and `<OUT>_TOKEN_LOGPROBS` / `<OUT>_TOKEN_RANKS` are 0 there and on padding.
`<OUT>_TOPK_TAIL` is 1 - sum(exp(top-k)), at least 0.

What an engine cannot compute is refused before any call, as `RequestRejectedError` naming what is
missing (the reader tries another teacher, then fails the batch with the message): dense outputs
(no `top_k`, no `token_logprobs`), the top-k of raw logits (`logprobs` off), `SCORE_IDS`, a
temperature other than 1 (engines report prompt log-probabilities before temperature: vLLM's
prompt log-probs skip its sampling processors), and any transform an engine has no field for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from distill.call_errors import MalformedAnswerError, RequestRejectedError
from distill.outputs import SCORED, TOKEN_LOGPROBS, TOKEN_RANKS, wanted_outputs
from distill.types import ChunkRequest, TensorMeta
from protos.kserve import DATATYPES
from protos.outputs import TOPK_INDICES, TOPK_TAIL, TOPK_VALUES

__all__ = ["ATTENTION_MASK", "ENGINE_INPUTS", "ENGINE_OUTPUTS", "INPUT_IDS", "LOGITS", "Plan", "RowScores", "assemble",
           "plan"]

INPUT_IDS = "INPUT_IDS"
ATTENTION_MASK = "ATTENTION_MASK"
LOGITS = "LOGITS"
ENGINE_INPUTS = {INPUT_IDS: TensorMeta(INPUT_IDS, "INT64", (-1,)),
                 ATTENTION_MASK: TensorMeta(ATTENTION_MASK, "INT64", (-1,))}
"""What an engine without a registry record declares: token ids and their mask, one row a sequence."""
ENGINE_OUTPUTS = {LOGITS: TensorMeta(LOGITS, "FP32", (-1, -1))}
"""...and its one output, the next-token distribution at every position (served reduced only)."""

# Request parameters an engine's answer carries (or that change nothing it computes).
_HANDLED = frozenset({"top_k", "logprobs", "temperature", "token_logprobs", "token_ranks", "topk_tail",
                      "output_dtype"})


@dataclass(frozen=True)
class Plan:
    """What one chunk asks of an engine: the prompts (its rows cut to their masks, in row order,
    rows that are all padding left out), where each sits in the padded width, and the outputs."""

    prompts: list[list[int]]
    rows: np.ndarray  # [P] the request's row of each prompt
    starts: np.ndarray  # [P] each prompt's first position in the padded width
    size: int  # the request's rows
    width: int  # its padded width
    k: int  # top-k per position (0: none asked)
    output: str  # the base output's name (LOGITS)
    names: tuple[str, ...]  # the outputs the answer carries, in the teacher's order
    values_dtype: torch.dtype  # of the top-k values
    probs_dtype: torch.dtype  # of the tail mass and token log-probs


@dataclass
class RowScores:
    """One prompt's decoded answer, per position t of the prompt (L positions): the top-k of the
    distribution predicting token t + 1, and that token's log-prob and rank (0 at t = L - 1)."""

    top_values: np.ndarray  # [L, k] float32
    top_ids: np.ndarray  # [L, k] int32
    token_logprobs: np.ndarray  # [L] float32
    token_ranks: np.ndarray | None  # [L] int32; None when the engine does not report ranks


def token_ids(ids: np.ndarray, field: str) -> np.ndarray:
    """An engine's token ids (int64, as read) as the int32 the mesh's outputs carry; an id outside
    0..2**31-1 is a MalformedAnswerError naming `field`, never an id wrapped round to another."""
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > np.iinfo(np.int32).max:
            raise MalformedAnswerError(f"{field} holds token id {low if low < 0 else high}, outside 0..2**31-1")
    return ids.astype(np.int32)


def _refuse(engine: str, what: str) -> RequestRejectedError:
    return RequestRejectedError(grpc.StatusCode.INVALID_ARGUMENT, f"{engine} cannot serve this request: {what}")


def _dtype(name: str) -> torch.dtype:
    return DATATYPES[name].torch_dtype


def plan(req: ChunkRequest, engine: str, *, ranks: bool) -> Plan:
    """The prompts and outputs of `req` for `engine` (its name, for messages); `ranks`: whether the
    engine reports the rank of a prompt's own tokens. RequestRejectedError for what it cannot compute."""
    p = req.parameters
    if "SCORE_IDS" in req.inputs:
        raise _refuse(engine, "input SCORE_IDS (log-probs at chosen ids) is not in an engine's API; ask a KServe "
                              "teacher, or use top_k and token_logprobs")
    unknown = sorted(name for name, value in p.items() if name not in _HANDLED and value not in (None, False))
    if unknown:
        raise _refuse(engine, f"transform parameter(s) {unknown} have no engine equivalent; ask a KServe teacher")
    outputs = req.outputs or (LOGITS,)
    if len(outputs) != 1:
        raise _refuse(engine, f"outputs {list(outputs)}: an engine has one output, the next-token distribution")
    output = outputs[0]
    k = int(p.get("top_k") or 0)
    temperature = p.get("temperature")
    if temperature is not None and float(temperature) != 1.0:
        raise _refuse(engine, f"temperature {temperature}: engines report prompt log-probs before temperature; "
                              "ask for temperature 1 (or leave it unset), or use a KServe teacher")
    if k and not p.get("logprobs"):
        raise _refuse(engine, "the top-k of raw logits: engines report log-probs only; ask for logprobs=True")
    names = tuple(wanted_outputs((output,), p))
    if names == (output,):
        raise _refuse(engine, f"dense {output} (every class at every position): engines report the top-k "
                              "log-probs only; ask for top_k (at most the engine's --max-logprobs) or token_logprobs")
    if not ranks and p.get("token_ranks"):
        raise _refuse(engine, "token_ranks: it does not report the rank of a prompt's tokens")
    if any(n.endswith(SCORED) for n in names):
        raise _refuse(engine, "scored log-probs at chosen ids")
    ids_name = INPUT_IDS if INPUT_IDS in req.inputs else next(iter(req.inputs))
    ids = np.asarray(req.rows(ids_name))
    if ids.ndim != 2:
        raise _refuse(engine, f"input {ids_name!r} has shape {list(ids.shape)}; engines take [rows, tokens]")
    size, width = ids.shape
    if ATTENTION_MASK in req.inputs:
        marked = np.asarray(np.asarray(req.rows(ATTENTION_MASK)).reshape(size, width, -1).any(axis=2))
    else:
        marked = np.ones((size, width), dtype=bool)
    counts = marked.sum(axis=1)
    kept = np.flatnonzero(counts)
    if not len(kept):
        raise _refuse(engine, f"input {ATTENTION_MASK!r} marks no position in any row: the request has nothing to "
                              "compute; send at least one real token per request")
    starts = marked.argmax(axis=1)[kept]
    stops = width - marked[:, ::-1].argmax(axis=1)[kept]
    prompts = [ids[r, a:b].tolist() for r, a, b in zip(kept.tolist(), starts.tolist(), stops.tolist(), strict=True)]
    base = req.declared.get(output)
    output_dtype = p.get("output_dtype")
    dt = str(output_dtype) if output_dtype else None
    return Plan(prompts, kept, starts, size, width, k, output, names,
                _dtype(TOPK_VALUES.datatype(dt, base.datatype if base is not None else "FP32")),
                _dtype(TOPK_TAIL.datatype(dt, "FP32")))


def assemble(pl: Plan, scores: Sequence[RowScores]) -> dict[str, torch.Tensor]:
    """The answer's tensors at the request's padded width, zeros at padding (module docstring)."""
    if len(scores) != len(pl.prompts):
        raise MalformedAnswerError(f"the engine answered {len(scores)} prompts; {len(pl.prompts)} were sent")
    k = pl.k
    values = np.zeros((pl.size, pl.width, k), dtype=np.float32)
    ids = np.zeros((pl.size, pl.width, k), dtype=np.int32)
    token_lp = np.zeros((pl.size, pl.width), dtype=np.float32)
    token_rank = np.zeros((pl.size, pl.width), dtype=np.int32)
    for i, (row, start, s) in enumerate(zip(pl.rows.tolist(), pl.starts.tolist(), scores, strict=True)):
        n = len(pl.prompts[i])
        if s.top_values.shape != (n, k) or s.top_ids.shape != (n, k) or s.token_logprobs.shape != (n,):
            raise MalformedAnswerError(
                f"prompt {i}: the engine's answer has top-k {list(s.top_values.shape)} and token log-probs "
                f"{list(s.token_logprobs.shape)} for {n} tokens at k {k}")
        values[row, start:start + n] = s.top_values
        ids[row, start:start + n] = s.top_ids
        token_lp[row, start:start + n - 1] = s.token_logprobs[:-1]
        if s.token_ranks is not None:
            token_rank[row, start:start + n - 1] = s.token_ranks[:-1]
    out: dict[str, torch.Tensor] = {}
    for name in pl.names:
        suffix = name[len(pl.output):]
        if suffix == TOPK_VALUES.suffix:
            out[name] = torch.from_numpy(values).to(pl.values_dtype)
        elif suffix == TOPK_INDICES.suffix:
            out[name] = torch.from_numpy(ids)
        elif suffix == TOPK_TAIL.suffix:
            tail = np.asarray(np.clip(1.0 - np.exp(values).sum(axis=-1), 0.0, None), dtype=np.float32)
            tail[~_positions(pl)] = 0.0
            out[name] = torch.from_numpy(tail).to(pl.probs_dtype)
        elif suffix == TOKEN_LOGPROBS:
            out[name] = torch.from_numpy(token_lp).to(pl.probs_dtype)
        elif suffix == TOKEN_RANKS:
            out[name] = torch.from_numpy(token_rank)
        else:  # plan() refuses what it does not list here
            raise MalformedAnswerError(f"output {name!r} cannot be built from an engine's answer")
    return out


def _positions(pl: Plan) -> np.ndarray:
    """[size, width] True at each prompt's positions (the rest is padding)."""
    mask = np.zeros((pl.size, pl.width), dtype=bool)
    for i, (row, start) in enumerate(zip(pl.rows.tolist(), pl.starts.tolist(), strict=True)):
        mask[row, start:start + len(pl.prompts[i])] = True
    return mask
