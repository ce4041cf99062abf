"""A vLLM engine as a teacher: its OpenAI `/v1/completions`, answered in the mesh's tensors.

One request per chunk: every row (cut to its mask) is a token-id prompt of `prompt`, with
`max_tokens: 1` and `prompt_logprobs: k`. vLLM's `prompt_logprobs[j]` scores prompt token j from
position j - 1's distribution: a map from token id to `{"logprob", "rank", "decoded_token"}` that
holds token j first (with its rank among the whole vocabulary) and then position j - 1's top-k in
rank order, token j once, at its top-k rank, when it is among them. So position t of the mesh's
answer (the distribution predicting token t + 1) is entry t + 1, and the row's last position, which
predicts the token after the row, is read the same way from one more prompt token: each prompt is
sent with its own last token repeated, whose entry is the last position's distribution (its own
log-prob is dropped: the teacher-server's is 0 there). The generated token is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from distill.call_errors import MalformedAnswerError
from distill.engines.client import EngineClient
from distill.engines.rows import Plan, RowScores

__all__ = ["VllmClient", "decode_prompt_logprobs"]


def decode_prompt_logprobs(entries: Any, prompt: Sequence[int], k: int) -> RowScores:
    """One choice's `prompt_logprobs` for `prompt` sent with its last token repeated, as the
    mesh's positions (module docstring); MalformedAnswerError when it does not fit."""
    n = len(prompt)
    if not isinstance(entries, list) or len(entries) != n + 1 or entries[0] is not None:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise MalformedAnswerError(f"prompt_logprobs has {got} entries for a prompt of {n + 1} tokens (want "
                                   f"{n + 1}: null, then one per token after the first)")
    values = np.empty((n, k), dtype=np.float64)
    ids = np.empty((n, k), dtype=np.int64)
    ranks = np.empty((n, k), dtype=np.int64)
    own_values = np.empty(n, dtype=np.float64)
    own_ranks = np.empty(n, dtype=np.int64)
    try:
        for t in range(n):
            items = list(entries[t + 1].items())
            token, own = items[0]
            expected = prompt[t + 1] if t + 1 < n else prompt[-1]
            if int(token) != expected:
                raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] starts with token {token}, not the prompt's "
                                           f"{expected}")
            own_values[t] = own["logprob"]
            own_ranks[t] = own["rank"]
            top = items[1:] if len(items) == k + 1 else items
            if len(top) != k:
                raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] has {len(items)} entries; want {k} or "
                                           f"{k + 1} for prompt_logprobs {k}")
            for j, (tid, entry) in enumerate(top):
                ids[t, j] = int(tid)
                values[t, j] = entry["logprob"]
                ranks[t, j] = entry["rank"]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, MalformedAnswerError):
            raise
        raise MalformedAnswerError(f"prompt_logprobs do not have vLLM's layout ({type(e).__name__}: {e})") from None
    order = np.argsort(ranks, axis=1, kind="stable")
    return RowScores(np.take_along_axis(values, order, axis=1).astype(np.float32),
                     np.take_along_axis(ids, order, axis=1).astype(np.int32),
                     own_values.astype(np.float32), own_ranks.astype(np.int32))


class VllmClient(EngineClient):
    """A vLLM OpenAI server (or anything answering its `/v1/completions` scoring subset, like
    teacher-server's HTTP front) as an `InferenceClient`."""

    engine = "vLLM"
    health_route = "/health"
    reports_ranks = True

    async def _score(self, pl: Plan, model: str, timeout: float) -> Sequence[RowScores]:
        body: dict[str, Any] = {"prompt": [[*p, p[-1]] for p in pl.prompts], "max_tokens": 1,
                                "prompt_logprobs": pl.k, "temperature": 1.0}
        if model:
            body["model"] = model
        answer = await self._http.call("POST", "/v1/completions", timeout, body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(pl.prompts):
            got = len(choices) if isinstance(choices, list) else "no"
            raise MalformedAnswerError(f"/v1/completions answered {got} choices for {len(pl.prompts)} prompts")
        try:
            ordered = sorted(choices, key=lambda c: int(c["index"]))
        except (KeyError, TypeError, ValueError):
            raise MalformedAnswerError("/v1/completions choices lack their integer 'index'") from None
        if [int(c["index"]) for c in ordered] != list(range(len(pl.prompts))):
            raise MalformedAnswerError("/v1/completions choices' indexes are not 0..n-1, one each")
        return [decode_prompt_logprobs(c.get("prompt_logprobs"), p, pl.k)
                for c, p in zip(ordered, pl.prompts, strict=True)]

    async def _models(self, timeout: float) -> list[str]:
        answer = await self._http.call("GET", "/v1/models", timeout)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise MalformedAnswerError(f"/v1/models of {self.endpoint} does not list models as "
                                       "{'data': [{'id': NAME}, ...]}")
        return [m["id"] for m in data]
