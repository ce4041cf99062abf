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
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from distill.call_errors import MalformedAnswerError
from distill.engines.client import EngineClient
from distill.engines.http import typed_json
from distill.engines.rows import Plan, RowScores, token_ids

__all__ = ["Choice", "Completion", "Logprob", "VllmClient", "decode_prompt_logprobs", "read_completion"]


class Logprob(msgspec.Struct, gc=False):
    """One entry of a position's map; its `decoded_token` is skipped unread."""

    logprob: float
    rank: int


class Choice(msgspec.Struct, gc=False):
    """One prompt's answer: per prompt token, null first, then a map from token id to its entry."""

    index: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class Completion(msgspec.Struct, gc=False):
    """The part of a `/v1/completions` answer the reader uses."""

    choices: list[Choice]


_COMPLETION = typed_json(Completion, "vLLM's /v1/completions layout")
_LOGPROB = attrgetter("logprob")
_RANK = attrgetter("rank")


def read_completion(raw: bytes) -> Completion:
    """A `/v1/completions` body as typed structs (`typed_json`): token ids come out as ints and
    the decoded text vLLM writes for every top-k entry, the bulk of the body, is never built."""
    answer: Completion = _COMPLETION(raw)
    return answer


def decode_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None, prompt: Sequence[int],
                           k: int) -> RowScores:
    """One choice's `prompt_logprobs` (as `read_completion` reads them) for `prompt` sent with its
    last token repeated, as the mesh's positions (module docstring); MalformedAnswerError when it
    does not fit.

    The entries are read into flat arrays (token ids, log-probs, ranks, in the answer's order), one
    pass each, and cut into positions by index arithmetic, never a Python step per entry: this runs
    for every token of every answer, on the reader's event loop."""
    n = len(prompt)
    if not isinstance(entries, list) or len(entries) != n + 1 or entries[0] is not None:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise MalformedAnswerError(f"prompt_logprobs has {got} entries for a prompt of {n + 1} tokens (want "
                                   f"{n + 1}: null, then one per token after the first)")
    rows: list[Any] = entries[1:]  # a null among them fails dict.values below, and is named there
    try:
        fields = list(chain.from_iterable(map(dict.values, rows)))
    except TypeError:  # a position that is not a map
        t = next(t for t, row in enumerate(rows) if not isinstance(row, dict))
        got = "null" if rows[t] is None else type(rows[t]).__name__
        raise MalformedAnswerError(f"prompt_logprobs[{t + 1}] is {got}, not vLLM's map from token id to its "
                                   "log-prob and rank") from None
    count = len(fields)
    try:
        ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=count)
        logprobs = np.fromiter(map(_LOGPROB, fields), dtype=np.float64, count=count)
        ranks = np.fromiter(map(_RANK, fields), dtype=np.int64, count=count)
    except (AttributeError, OverflowError, TypeError, ValueError) as e:
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
    return RowScores(logprobs[top].astype(np.float32), token_ids(ids[top], "prompt_logprobs"),
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
        answer: Completion = await self._http.call("POST", "/v1/completions", timeout, body, read_completion)
        choices = answer.choices
        if len(choices) != len(pl.prompts):
            raise MalformedAnswerError(f"/v1/completions answered {len(choices)} choices for {len(pl.prompts)} "
                                       "prompts")
        ordered = sorted(choices, key=lambda c: c.index)
        if [c.index for c in ordered] != list(range(len(pl.prompts))):
            raise MalformedAnswerError("/v1/completions choices' indexes are not 0..n-1, one each")
        return [decode_prompt_logprobs(c.prompt_logprobs, p, pl.k)
                for c, p in zip(ordered, pl.prompts, strict=True)]

    async def _models(self, timeout: float) -> list[str]:
        answer = await self._http.call("GET", "/v1/models", timeout)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise MalformedAnswerError(f"/v1/models of {self.endpoint} does not list models as "
                                       "{'data': [{'id': NAME}, ...]}")
        return [m["id"] for m in data]
