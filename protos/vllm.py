"""vLLM's OpenAI-compatible scoring subset, as JSON shapes: the wire format shared by the teacher
(`teacher_server.vllm_routes`) and the student-side gateway (`distill.gateway`).

LLM trainers (TRL's `VLLMClient.get_sequence_logprobs` and async distillation worker, verl's
teacher replicas) score sequences with one request shape: token-id prompts, `max_tokens: 1`,
`prompt_logprobs: k`, `temperature`. This module parses and checks that body
(`parse_completion`), names the teacher transforms that answer it (`scoring_parameters`: top-k,
log-probs, temperature, the prompt tokens' own log-probs and ranks, all reduced on the teacher's
device), and writes vLLM's answer from one prompt's reduced outputs (`Scored` -> `choice`,
`completion_body`). Position i of `prompt_logprobs` scores prompt token i from position i - 1's
distribution (vLLM's layout: `null` first); the one generated token is the greedy one, the top-1
at the last position. Temperature is applied to the reported log-probs (vLLM's
`--logprobs-mode processed_logprobs`, what TRL asks for); temperature 0 means greedy and scores at 1.

Nothing here touches the event loop, a socket or a model: the front ends do. It sits in `protos`
(wire formats) so that both sides import it downward and `distill` never imports `teacher_server`.
"""

from __future__ import annotations

import difflib
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

MAX_ECHO_CHARS = 64
"""How much of an offending value a refusal quotes."""


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)` cut to `limit` characters with the full length noted: a refusal quotes what it
    refuses without echoing a huge body back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str | bytes) else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"


MAX_PROMPT_LOGPROBS = 20
"""Most `prompt_logprobs` per position (vLLM's default --max-logprobs)."""

MAX_PROMPTS = 1024
"""Most prompts in one request."""

MAX_TOKENS = 1
"""Tokens generated per prompt: one greedy token, the scoring call's `max_tokens: 1`."""

LOGPROB_FLOOR = -9999.0
"""vLLM's stand-in for a log-probability of -inf, which JSON cannot carry."""

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}

# Fields of vLLM's completion request that do not change a one-token scoring answer: accepted and
# ignored, as vLLM ignores fields it does not use.
_IGNORED = frozenset({
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "user", "suffix", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "priority",
    "request_id", "logit_bias", "length_penalty", "use_beam_search", "cache_salt", "detokenize",
    "allowed_token_ids", "bad_words", "structured_outputs", "response_format", "stream_options",
    "return_tokens_as_token_ids", "top_logprobs", "max_completion_tokens", "kv_transfer_params", "vllm_xargs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "logits_processors", "prompt_embeds",
})
# Fields this endpoint acts on: a near-miss of one of them is refused, not ignored.
_KNOWN = ("model", "prompt", "max_tokens", "prompt_logprobs", "temperature", "return_token_ids",
          "add_special_tokens", "n", "best_of", "stream", "echo", "logprobs")


class APIError(Exception):
    """A refusal in OpenAI's form: HTTP `status`, `message` for the caller, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's (and vLLM's) error body: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed `/v1/completions` body. `prompts` are token-id lists, or strings when `text`."""

    prompts: Sequence[Sequence[int] | str]
    text: bool
    prompt_logprobs: int | None
    temperature: float
    model: str | None
    return_token_ids: bool = False
    add_special_tokens: bool = True


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(values: list[Any]) -> bool:
    """Whether every item of a parsed JSON list is an integer (JSON's ints are exactly `int`, never a
    bool); a set of the items' types, so no Python step per token."""
    return {*map(type, values)} <= {int}


def _prompts(raw: object) -> tuple[list[Any], bool]:
    if isinstance(raw, str):
        return [raw], True
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "prompt must be a token-id list, a list of them, a string or a list of strings "
                            "(not empty)", "prompt")
    if _ints(raw):
        return [raw], False
    if all(isinstance(p, str) for p in raw):
        return raw, True
    if not all(isinstance(p, list) for p in raw):
        raise APIError(400, "prompt mixes kinds: send one token-id list (ints), a list of token-id lists, or "
                            "strings", "prompt")
    for i, p in enumerate(raw):
        if not p:
            raise APIError(400, f"prompt {i} is empty; every prompt needs at least one token", "prompt")
        if not _ints(p):
            bad = next(t for t in p if not _int(t))
            raise APIError(400, f"prompt {i}: token ids must be integers, got {echo(bad)}", "prompt")
    return raw, False


def _check_fields(body: Mapping[str, Any]) -> None:
    for key in body:
        if key in _KNOWN or key in _IGNORED:
            continue
        close = difflib.get_close_matches(key, _KNOWN, n=1, cutoff=0.8)
        if close:
            raise APIError(400, f"unknown field {echo(key)}; did you mean {close[0]!r}? (fields this endpoint does "
                                "not use are ignored, but near-misses of its own are refused so that a typo cannot "
                                "silently change the answer)", key)


def parse_completion(raw: bytes, max_prompt_logprobs: int = MAX_PROMPT_LOGPROBS) -> CompletionRequest:
    """Parse and check a `/v1/completions` body; APIError(400) naming the first problem."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request's JSON does not parse: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request must be a JSON object with 'prompt'")
    _check_fields(body)
    if "prompt" not in body:
        raise APIError(400, "missing field 'prompt': send token ids (a list of ints, or a list of them)", "prompt")
    prompts, text = _prompts(body["prompt"])
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS} (split the batch)",
                       "prompt")
    max_tokens = body.get("max_tokens", MAX_TOKENS)
    if max_tokens is None:
        max_tokens = MAX_TOKENS
    if not _int(max_tokens) or max_tokens < 1 or max_tokens > MAX_TOKENS:
        raise APIError(400, f"max_tokens {echo(max_tokens)} is not served: this teacher scores prompts and "
                            "generates exactly one greedy token; send max_tokens: 1 with prompt_logprobs", "max_tokens")
    k = body.get("prompt_logprobs")
    if k is not None:
        if not _int(k) or k < -1:
            raise APIError(400, f"prompt_logprobs must be a non-negative integer or -1 (the whole vocabulary), got "
                                f"{echo(k)}", "prompt_logprobs")
        if max_prompt_logprobs != -1 and k > max_prompt_logprobs:
            raise too_many_logprobs(k, max_prompt_logprobs)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature) \
            or temperature < 0:
        raise APIError(400, f"temperature must be a finite number >= 0, got {echo(temperature)}", "temperature")
    for key, wanted, why in (("n", 1, "one completion per prompt"), ("best_of", 1, "one completion per prompt"),
                             ("stream", False, "answers are not streamed"), ("echo", False, "prompts are not echoed"),
                             ("logprobs", None, "log-probs of generated tokens are not served; ask for "
                                                "prompt_logprobs")):
        value = body.get(key, wanted)
        if value is not None and value != wanted and not (key == "logprobs" and value == 0):
            raise APIError(400, f"{key} {echo(value)} is not served ({why})", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {echo(model)}", "model")
    flags = {}
    for key in ("return_token_ids", "add_special_tokens"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"{key} must be a boolean, got {echo(value)}", key)
        flags[key] = value
    return CompletionRequest(prompts, text, k, float(temperature) or 1.0, model,
                             bool(flags["return_token_ids"]), flags["add_special_tokens"] is not False)


def too_many_logprobs(asked: int, limit: int, whole: bool = False) -> APIError:
    """The 400 for `asked` log-probs per position (`whole`: prompt_logprobs -1, the vocabulary's
    size) over the server's `limit`, in vLLM's words, naming the flag that raises the limit."""
    what = f"prompt_logprobs -1 asks for the whole vocabulary, {asked} tokens: " if whole else ""
    return APIError(400, f"{what}Requested prompt logprobs of {asked}, which is greater than max allowed: {limit}; "
                         f"start the server with --max-logprobs {asked} (or more), or ask for at most {limit}",
                    "prompt_logprobs")


def resolve_prompt_logprobs(k: int | None, vocab: int | None, limit: int) -> int | None:
    """The log-probs per position a body's `prompt_logprobs` asks for: `k` itself, or for -1 (vLLM's
    whole vocabulary) the vocabulary's size `vocab`, within `limit` (the server's --max-logprobs;
    -1: the vocabulary). APIError 400 naming --max-logprobs over it, or for -1 without a `vocab`."""
    if limit == -1:
        limit = vocab if vocab is not None else -1
    if k != -1:
        if k is not None and limit != -1 and k > limit:
            raise too_many_logprobs(k, limit)
        return k
    if vocab is None:
        most = f"at most {limit} (--max-logprobs)" if limit != -1 else "a number of"
        raise APIError(400, "prompt_logprobs -1 asks for the whole vocabulary, whose size this server does not know; "
                            f"ask for {most} log-probs per position", "prompt_logprobs")
    if limit != -1 and vocab > limit:
        raise too_many_logprobs(vocab, limit, whole=True)
    return vocab


def check_prompt(index: int, ids: Sequence[int], vocab: int | None, context: int | None) -> None:
    """One prompt's length and ids against the model's context and vocabulary (APIError 400)."""
    if context is not None and len(ids) > context:
        raise prompt_too_long(index, len(ids), context)
    limit = vocab if vocab is not None else 1 << 31
    low, high = min(ids), max(ids)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise token_out_of_vocabulary(index, bad, list(ids).index(bad), vocab)


def prompt_too_long(index: int, length: int, context: int) -> APIError:
    """The 400 for prompt `index` (its place in the body's `prompt` list) of `length` tokens, past
    the model's `context`."""
    return APIError(400, f"prompt {index} has {length} tokens; this model's maximum context length is {context} "
                         "tokens (max_model_len): shorten it", "prompt")


def token_out_of_vocabulary(index: int, token: int, position: int, vocab: int | None) -> APIError:
    """The 400 for token id `token` at `position` of prompt `index`, outside the model's `vocab`
    (None: undeclared, and ids must fit INT32)."""
    limit = vocab if vocab is not None else 1 << 31
    size = f"; the model's vocabulary has {vocab} tokens" if vocab is not None else ""
    return APIError(400, f"prompt {index}: token id {token} at position {position} is outside the vocabulary (ids "
                         f"must be in 0..{limit - 1}){size}", "prompt")


def outputs_not_finite(prompts: Sequence[int]) -> APIError:
    """The 500 for a body whose `prompts` (their places in `prompt`) the model answered with inf or
    NaN: never a log-probability of inf or NaN in a 200 answer."""
    return APIError(500, f"the model's outputs for prompt(s) {list(prompts)} are not finite (inf or NaN): it "
                         "overflowed on them; check those prompts, or serve the model in a wider dtype", "prompt")


def scoring_parameters(top_k: int, temperature: float) -> dict[str, object]:
    """The transform parameters of one prompt's request: everything reduced on the device."""
    return {"logprobs": True, "top_k": top_k, "temperature": temperature, "token_logprobs": True,
            "token_ranks": True, "topk_tail": False, "output_dtype": "FP32"}


@dataclass(frozen=True)
class Scored:
    """One prompt's device outputs, on the host: per position t the top-k log-probs and ids of
    the next token, and the log-prob and rank of the prompt's own token t + 1."""

    top_values: np.ndarray  # [T, k] float32
    top_ids: np.ndarray  # [T, k] int32
    token_logprobs: np.ndarray  # [T] float32
    token_ranks: np.ndarray  # [T] int32


Decoder = Callable[[Sequence[int]], Mapping[int, str]]


def choice(index: int, ids: Sequence[int], result: Scored, *, k: int | None, decode: Decoder | None,
           return_token_ids: bool, text: str | None = None) -> str:
    """One prompt's entry of `choices`, as JSON text, with vLLM's keys in vLLM's order: the greedy
    token (`text`: its text as it continues the prompt; default its decoded name) and, when
    asked, vLLM's prompt_logprobs; the fields not asked for are null, as vLLM writes them."""
    greedy = int(result.top_ids[-1, 0])
    names: Mapping[int, str] = {}
    if decode is not None:
        wanted = {greedy}
        if k is not None:
            wanted.update(int(i) for i in np.unique(result.top_ids[:-1, :k]))
            wanted.update(ids)
        names = decode(sorted(wanted))
    entry: dict[str, Any] = {"index": index, "text": names.get(greedy, "") if text is None else text,
                             "logprobs": None, "finish_reason": "length", "stop_reason": None,
                             "token_ids": [greedy] if return_token_ids else None}
    head = json.dumps(entry, separators=(",", ":"))
    prompt_ids = json.dumps(list(ids) if return_token_ids else None, separators=(",", ":"))
    scores = "null"
    if k is not None:
        quoted = {i: json.dumps(n) for i, n in names.items()} if decode is not None else None
        scores = prompt_logprobs(ids, result, k, quoted)
    return f'{head[:-1]},"prompt_logprobs":{scores},"prompt_token_ids":{prompt_ids},"routed_experts":null}}'


def _number(x: float) -> str:
    return repr(x) if math.isfinite(x) else "NaN"  # NaN as Python's json writes it (a model's NaN shows)


_ENTRY = '"%d":{"logprob":%s,"rank":%d,"decoded_token":null}'
_NAMED_ENTRY = '"%d":{"logprob":%s,"rank":%d,"decoded_token":%s}'


def prompt_logprobs(ids: Sequence[int], result: Scored, k: int, names: Mapping[int, str] | None) -> str:
    """vLLM's layout as JSON text: null for the first token, then per token i a map from token id
    (a string) to `{"logprob", "rank", "decoded_token"}`: token i itself first, with its true rank,
    then position i - 1's top-k in rank order. A token among the top-k is listed once, first, with
    its top-k rank (vLLM builds the map from [token i, top-k...], so the top-k entry overwrites the
    value of the key the token placed first). Written directly, not through dicts and json.dumps:
    the entries are laid out as flat columns with numpy, their floats written as text by orjson at
    once, and formatted by one `%` over a template of the whole answer. `names`:
    JSON-quoted decoded tokens."""
    n = len(ids) - 1  # positions written: tokens 1 .. T - 1
    if n <= 0:
        return "[null]"
    top_values = np.maximum(result.top_values[:n, :k], LOGPROB_FLOOR)
    own_values = np.maximum(result.token_logprobs[:n], LOGPROB_FLOOR)
    tokens = np.asarray(ids[1:], dtype=np.int64)
    top_ids = result.top_ids[:n, :k]
    hit = top_ids == tokens[:, None]  # [n, k]: the token at its place among the top-k, if it is there
    listed = hit.any(axis=1)
    if k:
        at = hit.argmax(axis=1)
        own_values = np.where(listed, top_values[np.arange(n), at], own_values)
        own_ranks = np.where(listed, at + 1, result.token_ranks[:n])
    else:
        own_ranks = result.token_ranks[:n]
    keep = np.concatenate([np.ones((n, 1), dtype=bool), ~hit], axis=1)  # [n, 1 + k]: own entry, then the rest
    flat_ids = np.concatenate([tokens[:, None], top_ids], axis=1)[keep].tolist()
    values = np.concatenate([own_values[:, None], top_values], axis=1)[keep].tolist()
    ranks = np.concatenate([own_ranks[:, None], np.broadcast_to(np.arange(1, k + 1), (n, k))], axis=1)[keep].tolist()
    if np.isfinite(top_values).all() and np.isfinite(own_values).all():
        # The floats' text, written in one call: `%s` of a float is its repr, the costliest step per
        # entry; orjson writes the same shortest digits (exponents as 1e-7, not 1e-07: the same number).
        values = orjson.dumps(values).decode()[1:-1].split(",")
    else:
        values = [_number(x) for x in values]
    entry = _ENTRY if names is None else _NAMED_ENTRY
    whole, short = "{" + ",".join([entry] * (k + 1)) + "}", "{" + ",".join([entry] * k) + "}"
    template = "[null," + ",".join([short if h else whole for h in listed.tolist()]) + "]"
    columns = 3 if names is None else 4
    args: list[Any] = [None] * (columns * len(values))
    args[0::columns], args[1::columns], args[2::columns] = flat_ids, values, ranks
    if names is not None:
        args[3::columns] = [names[i] for i in flat_ids]
    return template % tuple(args)


def completion_body(model: str, choices: list[str], prompt_tokens: int, fingerprint: str = "") -> bytes:
    """The whole `/v1/completions` answer, around the choices' JSON text, with vLLM's keys in
    vLLM's order (those this server has no value for are null). `system_fingerprint` is the
    teacher's fingerprint (`teacher_server.fingerprint`; null when not known), as OpenAI's field
    names the backend configuration that answered."""
    head = json.dumps({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                       "model": model}, separators=(",", ":"))
    usage = json.dumps({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(choices),
                        "completion_tokens": len(choices), "prompt_tokens_details": None,
                        "completion_tokens_details": None}, separators=(",", ":"))
    system = json.dumps(fingerprint or None)
    return (f'{head[:-1]},"choices":[{",".join(choices)}],"service_tier":null,"system_fingerprint":{system},'
            f'"usage":{usage},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}}').encode()


def models_body(name: str, max_model_len: int | None, fingerprint: str = "") -> dict[str, Any]:
    """`/v1/models`: the one model served (`data[0].id` is what clients name in `model`), with its
    `fingerprint` (`teacher_server.fingerprint`) when known: the same value every
    `/v1/completions` answer carries as `system_fingerprint`."""
    card: dict[str, Any] = {
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "distill-mesh", "root": name,
        "parent": None, "max_model_len": max_model_len, "permission": []}
    if fingerprint:
        card["fingerprint"] = fingerprint
    return {"object": "list", "data": [card]}
