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
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from distill.call_errors import MalformedAnswerError
from distill.engines.client import EngineClient
from distill.engines.rows import Plan, RowScores

__all__ = ["VllmClient", "decode_prompt_logprobs"]


_LOGPROB = itemgetter("logprob")
_RANK = itemgetter("rank")


def decode_prompt_logprobs(entries: Any, prompt: Sequence[int], k: int) -> RowScores:
    """One choice's `prompt_logprobs` for `prompt` sent with its last token repeated, as the
    mesh's positions (module docstring); MalformedAnswerError when it does not fit.

    The entries are read into flat arrays (token ids, log-probs, ranks, in the answer's order), one
    pass each, and cut into positions by index arithmetic, never a Python step per entry: this runs
    for every token of every answer, on the reader's event loop."""
    n = len(prompt)
    if not isinstance(entries, list) or len(entries) != n + 1 or entries[0] is not None:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise MalformedAnswerError(f"prompt_logprobs has {got} entries for a prompt of {n + 1} tokens (want "
                                   f"{n + 1}: null, then one per token after the first)")
    rows = entries[1:]
    try:
        fields = list(chain.from_iterable(map(dict.values, rows)))
    except TypeError:  # a position that is not a map
        t = next(t for t, row in enumerate(rows) if not isinstance(row, dict))
        got = "null" if rows[t] is None else type(rows[t]).__name__
        raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] is {got}, not vLLM's map from token id to its "
                                   "log-prob and rank") from None
    count = len(fields)
    try:
        ids = np.fromiter(map(int, chain.from_iterable(rows)), dtype=np.int64, count=count)
        logprobs = np.fromiter(map(_LOGPROB, fields), dtype=np.float64, count=count)
        ranks = np.fromiter(map(_RANK, fields), dtype=np.int64, count=count)
    except (KeyError, OverflowError, TypeError, ValueError) as e:
        raise MalformedAnswerError(f"prompt_logprobs do not have vLLM's layout ({type(e).__name__}: {e})") from None
    sizes = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    firsts = np.cumsum(sizes) - sizes  # each position's first entry: the prompt's own token
    expected = np.asarray([*prompt[1:], prompt[-1]], dtype=np.int64)
    # The first position that does not fit, and why (a wrong token before a wrong count at one position).
    held = np.flatnonzero(sizes > 0)
    wrong_token = held[ids[firsts[held]] != expected[held]]
    wrong_size = np.flatnonzero((sizes != k + 1) & ((sizes != k) | (k == 0)))
    t = int(min(wrong_token[0] if len(wrong_token) else n, wrong_size[0] if len(wrong_size) else n))
    if t < n and len(wrong_token) and wrong_token[0] == t:
        raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] starts with token {ids[firsts[t]]}, not the prompt's "
                                   f"{expected[t]}")
    if t < n:
        want = f"{k} or {k + 1}" if k else "1"
        raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] has {sizes[t]} entries; want {want} for "
                                   f"prompt_logprobs {k}")
    # Each position's top-k are its last k entries (the own token comes first unless it is among them).
    top = (firsts + sizes - k)[:, None] + np.arange(k)
    top = np.take_along_axis(top, np.argsort(ranks[top], axis=1, kind="stable"), axis=1)
    return RowScores(logprobs[top].astype(np.float32), ids[top].astype(np.int32),
                     logprobs[firsts].astype(np.float32), ranks[firsts].astype(np.int32))


class VllmClient(EngineClient):
    """A vLLM OpenAI server (or anything answering its `/v1/completions` scoring subset, like
    teacher-server's HTTP front) as an `InferenceClient`."""

    engine = "vLLM"
    health_route = "/health"
    reports_ranks = True

    async def _score(self, pl: Plan, model: str, timeout: float) -> Sequence[RowScores]:
        # Each prompt gets its last token again, so the answer scores the position after it too. One
        # prompt goes as a flat list of ids, as clients send one: vLLM spends a few percent more CPU on
        # a list of prompts, even of one (benchmarks.engines).
        prompts = [[*p, p[-1]] for p in pl.prompts]
        body: dict[str, Any] = {"prompt": prompts[0] if len(prompts) == 1 else prompts, "max_tokens": 1,
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
