"""vLLM's `prompt_logprobs` and SGLang's `meta_info` between the mesh's arrays and JSON text, without a server.

The writer (`protos.vllm.prompt_logprobs`: the gateway's and teacher-server's answers, checked
against real vLLM's by tests/test_vllm_parity.py) and the reader's decoder
(`distill.engines.vllm.decode_prompt_logprobs`) are each other's inverse: what one writes for a
prompt sent with its last token repeated, the other reads back as the same top-k, ids, and the
prompt tokens' own log-probs and ranks. Every answer here goes through the bytes the reader gets:
`read_completion` reads a whole `/v1/completions` body, then the decoder cuts it into positions. An
answer that does not fit vLLM's layout is refused with `MalformedAnswerError` naming the position.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from distill.call_errors import MalformedAnswerError
from distill.engines.rows import RowScores
from distill.engines.sglang import decode_meta_info, read_results
from distill.engines.vllm import decode_prompt_logprobs, read_completion
from protos.vllm import Scored, prompt_logprobs

VOCAB = 300
N = 40


def answer(k: int, seed: int) -> tuple[list[int], Scored]:
    """A prompt of N tokens and a teacher's arrays for it sent with its last token repeated (N + 1
    positions): distinct top-k ids per position in falling log-prob order, the next token among
    them at about a third of the positions."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, N).tolist()
    sent = [*prompt, prompt[-1]]
    top_ids = np.stack([rng.choice(VOCAB, k, replace=False) for _ in sent]).astype(np.int32).reshape(N + 1, k)
    for t in range(N):
        if k and t % 3 == 0 and sent[t + 1] not in top_ids[t]:
            top_ids[t, rng.integers(k)] = sent[t + 1]
    top_values = -np.sort(rng.uniform(0.1, 12.0, (N + 1, k)), axis=1).astype(np.float32)
    own = -rng.uniform(0.1, 20.0, N + 1).astype(np.float32)
    ranks = rng.integers(k + 1, VOCAB, N + 1).astype(np.int32)
    return prompt, Scored(top_values, top_ids, own, ranks)


def decode(entries: Any, prompt: list[int], k: int) -> RowScores:
    """`entries` (JSON text, or Python objects to write as JSON) as the one choice of a body."""
    text = entries if isinstance(entries, str) else json.dumps(entries)
    body = f'{{"id":"cmpl-1","choices":[{{"index":0,"text":"","prompt_logprobs":{text}}}],"usage":null}}'
    answer = read_completion(body.encode())
    return decode_prompt_logprobs(answer.choices[0].prompt_logprobs, prompt, k)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_the_decoder_reads_back_what_the_writer_wrote(k: int) -> None:
    prompt, result = answer(k, seed=k)
    sent = [*prompt, prompt[-1]]
    got = decode(prompt_logprobs(sent, result, k, None), prompt, k)

    assert np.array_equal(got.top_ids, result.top_ids[:N]) and got.top_ids.dtype == np.int32
    assert np.array_equal(got.top_values, result.top_values[:N]) and got.top_values.dtype == np.float32
    # A token among the top-k is written once, with its top-k value and rank; the others with their own.
    own, own_ranks = result.token_logprobs[:N].copy(), result.token_ranks[:N].copy()
    inside = 0
    for t in range(N):
        row = result.top_ids[t].tolist()
        if sent[t + 1] in row:
            j = row.index(sent[t + 1])
            own[t], own_ranks[t] = result.top_values[t, j], j + 1
            inside += 1
    assert k == 0 or 0 < inside < N  # both layouts of a position are exercised
    assert got.token_ranks is not None
    assert np.array_equal(got.token_logprobs, own) and np.array_equal(got.token_ranks, own_ranks)


def test_top_k_entries_out_of_rank_order_are_put_in_it() -> None:
    k = 5
    prompt, result = answer(k, seed=7)
    entries = json.loads(prompt_logprobs([*prompt, prompt[-1]], result, k, None))
    shuffled = [entries[0]]
    for position in entries[1:]:
        items = list(position.items())
        shuffled.append(dict([items[0], *reversed(items[1:])]))
    got = decode(shuffled, prompt, k)
    assert np.array_equal(got.top_ids, result.top_ids[:N])
    assert np.array_equal(got.top_values, result.top_values[:N])


def _position(t: int, change: Callable[[dict[str, Any]], Any]) -> Callable[[list[Any]], list[Any]]:
    def mutate(entries: list[Any]) -> list[Any]:
        entries[t] = change(entries[t])
        return entries
    return mutate


def _other_first_token(position: dict[str, Any]) -> dict[str, Any]:
    items = list(position.items())
    return dict([(str(VOCAB + 1), items[0][1]), *items[1:]])


def _drop_last(position: dict[str, Any]) -> dict[str, Any]:
    return dict(list(position.items())[:-2])


def _last_id(position: dict[str, Any], token: int) -> dict[str, Any]:
    """The position's last top-k entry under another token id (an id int32 cannot hold, a wrapped
    one would be another token)."""
    items = list(position.items())
    return dict([*items[:-1], (str(token), items[-1][1])])


def _no_rank(position: dict[str, Any]) -> dict[str, Any]:
    first = next(iter(position))
    position[first] = {"logprob": -1.0}
    return position


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda e: {"0": e},
     r"completions layout: Expected `array \| null`, got `object` - at `\$.choices\[0\].prompt_logprobs`"),
    (lambda e: e[:-1], r"prompt_logprobs has 40 entries for a prompt of 41 tokens"),
    (lambda e: [e[1], *e[1:]], r"prompt_logprobs has 41 entries .*null, then one per token"),
    (_position(2, lambda p: None), r"prompt_logprobs\[2\] is null, not vLLM's map"),
    (_position(5, lambda p: list(p.items())), r"got `array` - at `\$.choices\[0\].prompt_logprobs\[5\]`"),
    (_position(3, _other_first_token), rf"prompt_logprobs\[3\] starts with token {VOCAB + 1}, not the prompt's"),
    (_position(4, _drop_last), r"prompt_logprobs\[4\] has \d+ entries; want 5 or 6 for prompt_logprobs 5"),
    (_position(6, _no_rank), r"missing required field `rank` - at `\$.choices\[0\].prompt_logprobs\[6\]"),
    (_position(7, lambda p: {f"w{i}": v for i, v in p.items()}),
     r"Expected `int`, got `str` - at `key` in `\$.choices\[0\].prompt_logprobs\[7\]`"),
    (_position(8, lambda p: {str(2**64): v for v in p.values()}), r"do not have vLLM's layout \(OverflowError"),
    (_position(9, lambda p: _last_id(p, 2**40)),
     r"prompt_logprobs holds token id 1099511627776, outside 0\.\.2\*\*31-1"),
    (_position(9, lambda p: _last_id(p, -3)), r"prompt_logprobs holds token id -3, outside 0\.\.2\*\*31-1"),
], ids=["not-a-list", "too-few", "no-leading-null", "null-position", "list-position", "wrong-token",
        "too-few-entries", "no-rank", "key-not-an-id", "id-past-int64", "id-past-int32", "negative-id"])
def test_an_answer_that_does_not_fit_is_refused_naming_where(mutate: Callable[[list[Any]], Any],
                                                             message: str) -> None:
    k = 5
    prompt, result = answer(k, seed=3)
    entries = json.loads(prompt_logprobs([*prompt, prompt[-1]], result, k, None))
    with pytest.raises(MalformedAnswerError, match=message):
        decode(mutate(entries), prompt, k)


def test_log_probs_of_every_magnitude_are_written_exactly() -> None:
    """Log-probs near 0 (a token the model is sure of) and far below it are written in exponent form
    by the writer; read back by Python's json, each is the float32 the teacher computed, bit for bit."""
    prompt, result = answer(3, seed=7)
    magnitudes = np.array([-0.0, -1.2e-7, -3.0517578e-5, -1e-12, -0.1, -1e-300, -88.72, -9.5e3], dtype=np.float32)
    values = np.resize(magnitudes, result.top_values.size).reshape(result.top_values.shape)
    result = Scored(-np.sort(-values, axis=1), result.top_ids, result.token_logprobs, result.token_ranks)
    text = prompt_logprobs([*prompt, prompt[-1]], result, 3, None)
    got = decode(text, prompt, 3)
    assert "e-" in text  # exponent forms were written
    assert np.array_equal(got.top_values.view(np.int32), result.top_values[:N].view(np.int32))


def test_a_body_with_non_finite_log_probs_is_read_as_python_writes_them() -> None:
    """Strict JSON has no NaN or Infinity; a server in Python writes them for a model's non-finite
    log-prob. Such a body is still read, its values as the floats they name, and the rest exact."""
    prompt, result = answer(2, seed=11)
    text = prompt_logprobs([*prompt, prompt[-1]], result, 2, None)
    first = str(result.top_values[0, 0].item())
    assert text.count(first) >= 1
    got = decode(text.replace(first, "-Infinity", 1), prompt, 2)
    assert got.top_values[0, 0] == -np.inf
    assert np.array_equal(got.top_values[1:], result.top_values[1:N])


def test_a_body_that_is_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"Expecting value|JSON"):
        read_completion(b'{"choices": [')


# ---- SGLang's `/generate` ------------------------------------------------------------------------

def sglang_body(prompt: list[int], result: Scored, k: int) -> list[Any]:
    """SGLang's answer for `prompt` from a teacher's arrays over its N positions (as
    tests/sglang_server.py writes it from a model): per prompt token j, its own log-prob given the
    tokens before it (null for j = 0) and position j - 1's top-k as `[logprob, id, null]` triples,
    then the top-k after the whole prompt."""
    def triples(t: int) -> list[list[Any]]:
        return [[float(v), int(i), None] for v, i in zip(result.top_values[t], result.top_ids[t], strict=True)]
    meta = {"id": "x", "prompt_tokens": len(prompt),
            "input_token_logprobs": [[None if j == 0 else float(result.token_logprobs[j - 1]), prompt[j], None]
                                     for j in range(len(prompt))],
            "input_top_logprobs": [None if j == 0 else triples(j - 1) for j in range(len(prompt))],
            "output_top_logprobs": [triples(len(prompt) - 1)], "output_token_logprobs": [[-0.5, 7, None]]}
    return [{"text": " w7", "output_ids": [7], "meta_info": meta}]


def sglang_decode(body: Any, prompt: list[int], k: int) -> RowScores:
    results = read_results(json.dumps(body).encode())
    return decode_meta_info(results[0].meta_info, prompt, k)


@pytest.mark.parametrize("k", [0, 1, 20])
def test_sglang_answers_are_read_back_as_the_arrays_they_were_written_from(k: int) -> None:
    prompt, result = answer(k, seed=20 + k)
    got = sglang_decode(sglang_body(prompt, result, k), prompt, k)
    assert np.array_equal(got.top_values, result.top_values[:N]) and got.top_values.dtype == np.float32
    assert np.array_equal(got.top_ids, result.top_ids[:N]) and got.top_ids.dtype == np.int32
    own = result.token_logprobs[:N].copy()
    own[-1] = 0.0  # the last position's next token is not in the prompt
    assert np.array_equal(got.token_logprobs, own) and got.token_ranks is None


def _meta(change: Callable[[dict[str, Any]], Any]) -> Callable[[list[Any]], list[Any]]:
    def mutate(body: list[Any]) -> list[Any]:
        change(body[0]["meta_info"])
        return body
    return mutate


def _set(key: str, index: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        meta[key][index] = value
    return change


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b[0], r"SGLang's /generate layout: Expected `array`, got `object`$"),
    (_meta(lambda m: m.pop("input_top_logprobs")), r"missing required field `input_top_logprobs` - at `\$\[0\]"),
    (_meta(lambda m: m["input_token_logprobs"].pop()), r"39 input token log-probs and 40 input top log-probs for a "
                                                       r"prompt of 40 tokens"),
    (_meta(_set("input_top_logprobs", 4, None)), r"input_top_logprobs\[4\] is null; want 5 entries"),
    (_meta(lambda m: m["input_top_logprobs"][6].pop()), r"input_top_logprobs\[6\] is 4 entries; want 5"),
    (_meta(lambda m: m["output_top_logprobs"][0].pop()), r"output_top_logprobs\[0\] is 4 entries; want 5"),
    (_meta(lambda m: m.update(output_top_logprobs=[])), r"output_top_logprobs is empty"),
    (_meta(lambda m: m["input_token_logprobs"][3].__setitem__(1, VOCAB + 1)),
     rf"input_token_logprobs\[3\] is for token {VOCAB + 1}, not the prompt's"),
    (_meta(lambda m: m["input_token_logprobs"][5].__setitem__(0, None)),
     r"input_token_logprobs\[5\] has a null log-prob"),
    (_meta(lambda m: m["input_top_logprobs"][2][0].__setitem__(0, "x")),
     r"Expected `float`, got `str` - at `\$\[0\]\.meta_info\.input_top_logprobs\[2\]\[0\]\[0\]`"),
    (_meta(lambda m: m["input_top_logprobs"][2][0].__setitem__(1, 2**40)),
     r"input_top_logprobs holds token id 1099511627776, outside 0\.\.2\*\*31-1"),
], ids=["not-a-list", "no-top-logprobs", "too-few-tokens", "null-position", "short-position", "short-last",
        "no-last", "wrong-token", "null-own-log-prob", "value-not-a-number", "id-past-int32"])
def test_an_sglang_answer_that_does_not_fit_is_refused_naming_where(mutate: Callable[[list[Any]], Any],
                                                                    message: str) -> None:
    k = 5
    prompt, result = answer(k, seed=9)
    with pytest.raises(MalformedAnswerError, match=message):
        sglang_decode(mutate(sglang_body(prompt, result, k)), prompt, k)
