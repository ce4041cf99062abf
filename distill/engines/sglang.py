"""An SGLang engine as a teacher: its native `/generate`, answered in the mesh's tensors.

One request per chunk: every row (cut to its mask) is one list of `input_ids`, with
`sampling_params: {max_new_tokens: 1, temperature}`, `return_logprob: true`,
`logprob_start_len: 0` (log-probs from the first prompt token on) and `top_logprobs_num: k`. SGLang
answers one object per prompt whose `meta_info` holds, per prompt token j, `input_token_logprobs[j]`
= `[logprob, token_id, text]` (token j's log-prob given the tokens before it; null logprob for
j = 0) and `input_top_logprobs[j]` = position j - 1's top-k as such triples (null for j = 0), and
`output_top_logprobs[0]`, the top-k of the distribution after the whole prompt. So position t of
the mesh's answer is entry t + 1 for t < L - 1, and the row's last position is
`output_top_logprobs[0]`. SGLang does not report the rank of a prompt's tokens, so `token_ranks`
is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np

from distill.call_errors import MalformedAnswerError
from distill.engines.client import EngineClient
from distill.engines.http import typed_json
from distill.engines.rows import Plan, RowScores, token_ids

__all__ = ["MetaInfo", "Result", "SglangClient", "decode_meta_info", "read_results"]

Triple = tuple[float, int, Any]
"""`[logprob, token_id, text]`; the text (null unless `return_text_in_logprobs`) is not read."""


class MetaInfo(msgspec.Struct, gc=False):
    """The log-prob fields of one result's `meta_info`, per prompt token (module docstring)."""

    input_token_logprobs: list[tuple[float | None, int, Any]]
    input_top_logprobs: list[list[Triple] | None]
    output_top_logprobs: list[list[Triple]]


class Result(msgspec.Struct, gc=False):
    meta_info: MetaInfo


_RESULTS = typed_json(list[Result], "SGLang's /generate layout")
_FIRST = itemgetter(0)
_SECOND = itemgetter(1)


def read_results(raw: bytes) -> list[Result]:
    """A `/generate` body for a list of prompts as typed structs (`typed_json`)."""
    results: list[Result] = _RESULTS(raw)
    return results


def decode_meta_info(meta: MetaInfo, prompt: Sequence[int], k: int) -> RowScores:
    """One prompt's `meta_info` (as `read_results` reads it) as the mesh's positions (module
    docstring); MalformedAnswerError when it does not fit. Read into flat arrays, one pass each,
    never a Python step per position, as vLLM's answers are."""
    n = len(prompt)
    tokens, tops = meta.input_token_logprobs, meta.input_top_logprobs
    if len(tokens) != n or len(tops) != n:
        raise MalformedAnswerError(f"meta_info has {len(tokens)} input token log-probs and {len(tops)} input top "
                                   f"log-probs for a prompt of {n} tokens")
    if not meta.output_top_logprobs:
        raise MalformedAnswerError("meta_info's output_top_logprobs is empty: it holds the top-k after the prompt")
    # Position t: prompt token t + 1's own log-prob and top-k (entry t + 1), then the last position's
    # top-k from the distribution after the whole prompt.
    rows: list[Any] = [*tops[1:], meta.output_top_logprobs[0]]
    held = np.fromiter(map(len, (r or () for r in rows)), dtype=np.int64, count=n)
    wrong = np.flatnonzero(held != k)
    if len(wrong):
        t = int(wrong[0])
        where = f"input_top_logprobs[{t + 1}]" if t + 1 < n else "output_top_logprobs[0]"
        got = "null" if rows[t] is None else f"{held[t]} entries"
        raise MalformedAnswerError(f"{where} is {got}; want {k} entries for top_logprobs_num {k}")
    flat = list(chain.from_iterable(rows))
    values = np.fromiter(map(_FIRST, flat), dtype=np.float32, count=n * k).reshape(n, k)
    ids = np.fromiter(map(_SECOND, flat), dtype=np.int64, count=n * k).reshape(n, k)
    own = np.zeros(n, dtype=np.float32)
    if n > 1:
        scored = tokens[1:]
        got_ids = np.fromiter(map(_SECOND, scored), dtype=np.int64, count=n - 1)
        bad = np.flatnonzero(got_ids != np.asarray(prompt[1:], dtype=np.int64))
        if len(bad):
            t = int(bad[0]) + 1
            raise MalformedAnswerError(f"input_token_logprobs[{t}] is for token {got_ids[t - 1]}, not the prompt's "
                                       f"{prompt[t]}")
        logprobs = list(map(_FIRST, scored))
        if None in logprobs:
            raise MalformedAnswerError(f"input_token_logprobs[{logprobs.index(None) + 1}] has a null log-prob; only "
                                       "the first token's may be null")
        own[:-1] = logprobs
    return RowScores(values, token_ids(ids, "input_top_logprobs"), own, None)


class SglangClient(EngineClient):
    """An SGLang server's native API as an `InferenceClient`."""

    engine = "SGLang"
    health_route = "/health"
    reports_ranks = False

    async def _score(self, pl: Plan, model: str, timeout: float) -> Sequence[RowScores]:
        body: dict[str, Any] = {"input_ids": pl.prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": pl.k}
        answer: list[Result] = await self._http.call("POST", "/generate", timeout, body, read_results)
        if len(answer) != len(pl.prompts):
            raise MalformedAnswerError(f"/generate answered {len(answer)} results for {len(pl.prompts)} prompts")
        return [decode_meta_info(a.meta_info, p, pl.k) for a, p in zip(answer, pl.prompts, strict=True)]

    async def _models(self, timeout: float) -> list[str]:
        answer = await self._http.call("GET", "/get_model_info", timeout)
        path = answer.get("model_path") if isinstance(answer, dict) else None
        if not isinstance(path, str) or not path:
            raise MalformedAnswerError(f"/get_model_info of {self.endpoint} has no 'model_path'")
        return [path]
