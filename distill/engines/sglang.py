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
from typing import Any

import numpy as np

from distill.call_errors import MalformedAnswerError
from distill.engines.client import EngineClient
from distill.engines.rows import Plan, RowScores

__all__ = ["SglangClient", "decode_meta_info"]


def _triples(top: Any, k: int, where: str) -> tuple[list[float], list[int]]:
    if not isinstance(top, list) or len(top) != k:
        got = len(top) if isinstance(top, list) else type(top).__name__
        raise MalformedAnswerError(f"{where} has {got} entries; want {k} for top_logprobs_num {k}")
    return [float(e[0]) for e in top], [int(e[1]) for e in top]


def decode_meta_info(meta: Any, prompt: Sequence[int], k: int) -> RowScores:
    """One prompt's `meta_info` as the mesh's positions (module docstring); MalformedAnswerError
    when it does not fit."""
    n = len(prompt)
    try:
        tokens = meta["input_token_logprobs"]
        tops = meta["input_top_logprobs"]
        last = meta["output_top_logprobs"][0]
        if len(tokens) != n or len(tops) != n:
            raise MalformedAnswerError(f"meta_info has {len(tokens)} input token log-probs and {len(tops)} input "
                                       f"top log-probs for a prompt of {n} tokens")
        values = np.empty((n, k), dtype=np.float32)
        ids = np.empty((n, k), dtype=np.int32)
        own = np.zeros(n, dtype=np.float32)
        for t in range(n):
            if t + 1 < n:
                logprob, token = tokens[t + 1][0], int(tokens[t + 1][1])
                if token != prompt[t + 1]:
                    raise MalformedAnswerError(f"input_token_logprobs[{t + 1}] is for token {token}, not the "
                                               f"prompt's {prompt[t + 1]}")
                own[t] = logprob
                values[t], ids[t] = _triples(tops[t + 1], k, f"input_top_logprobs[{t + 1}]")
            else:
                values[t], ids[t] = _triples(last, k, "output_top_logprobs[0]")
    except MalformedAnswerError:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise MalformedAnswerError(f"meta_info does not have SGLang's layout ({type(e).__name__}: {e})") from None
    return RowScores(values, ids, own, None)


class SglangClient(EngineClient):
    """An SGLang server's native API as an `InferenceClient`."""

    engine = "SGLang"
    health_route = "/health"
    reports_ranks = False

    async def _score(self, pl: Plan, model: str, timeout: float) -> Sequence[RowScores]:
        body: dict[str, Any] = {"input_ids": pl.prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": pl.k}
        answer = await self._http.call("POST", "/generate", timeout, body)
        if not isinstance(answer, list) or len(answer) != len(pl.prompts):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise MalformedAnswerError(f"/generate answered {got} results for {len(pl.prompts)} prompts")
        return [decode_meta_info(a.get("meta_info") if isinstance(a, dict) else None, p, pl.k)
                for a, p in zip(answer, pl.prompts, strict=True)]

    async def _models(self, timeout: float) -> list[str]:
        answer = await self._http.call("GET", "/get_model_info", timeout)
        path = answer.get("model_path") if isinstance(answer, dict) else None
        if not isinstance(path, str) or not path:
            raise MalformedAnswerError(f"/get_model_info of {self.endpoint} has no 'model_path'")
        return [path]
