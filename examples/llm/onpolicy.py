"""On-policy distillation for the LLM example: the student samples, the served teacher scores.

One on-policy step (staleness 0: the samples come from the weights the step updates):

1. ``sample``: the student continues ``B`` prompts of ``P`` tokens from the training split by
   ``N`` tokens, sampled from its own distribution (temperature 1, no top-k or top-p cut), with a
   KV cache, on the training loop's thread. Beside each sampled token it keeps the student's own
   top-``k`` ids at that position (``score_ids``, the ``SCORE_IDS`` input) and the student's
   log-probability of the sampled token.
2. ``DistillReader(None, ...).score(batch)`` (``reader_options``): the teacher server scores the
   sequence: ``<OUT>_TOKEN_LOGPROBS`` (``log p`` of each sampled token), ``<OUT>_SCORED_LOGPROBS``
   (``log p`` at the student's top-k) and its own top-k log-probabilities, all from its full
   softmax on its device. Only ``[B, T]`` and ``[B, T, k]`` tensors cross the wire.
3. ``on_policy_loss``: the reverse KL ``KL(q ‖ p)`` on the union of the student's top-k, the
   teacher's top-k and the sampled token, plus one tail bin each (``ScoredTargets``,
   ``TokenKDLoss("reverse_kl")``), over the ``N`` positions that predict a sampled token.

A teacher-scored token here is one of those ``N`` positions per sequence; the off-policy KD arm's
are the positions of training sequences that have a next token. ``teacher_nll`` is the held-out
measure of what on-policy distillation optimises: the teacher's mean negative log-likelihood of
continuations the (trained) student samples from held-out prompts, with the student's own mean NLL
of them beside it (their difference estimates ``KL(q ‖ p)`` per token).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from distill.losses import ScoredTargets, TokenKDLoss
from examples.llm.mesh import MODEL_NAME
from examples.llm.student import OUTPUT

SCORE_INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask", "SCORE_IDS": "score_ids"}
TOKEN_INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask"}


class Scorer(Protocol):
    """What scores a batch the training loop made: ``DistillReader(None, **reader_options(...))``."""

    def score(self, batch: Any, *, deadline_s: float | None = None) -> Any:
        """The teacher outputs of ``batch`` (a dict of tensors), waiting for them."""
        ...


def reader_options(*, teachers: str, k: int, temperature: float = 1.0, scoring: bool = True,
                   timeout: float = 60.0) -> dict[str, Any]:
    """``DistillReader(None, **options)`` keywords for on-policy scoring.

    ``scoring``: the training step's request (the sampled tokens' log-probabilities, the
    log-probabilities at ``SCORE_IDS`` and the teacher's top-``k``); otherwise only the sampled
    tokens' log-probabilities (the evaluation's). Every setting is stated per request, float32.
    """
    options: dict[str, Any] = {
        "teachers": teachers, "model": MODEL_NAME, "outputs": [OUTPUT], "token_logprobs": True,
        "temperature": temperature, "logprobs": True, "output_dtype": "FP32", "timeout": timeout, "prefetch": 2}
    if scoring:
        return {**options, "inputs": SCORE_INPUTS, "top_k": k, "topk_tail": False}
    return {**options, "inputs": TOKEN_INPUTS, "top_k": 0}


@dataclass(frozen=True)
class Rollout:
    """``B`` prompts continued by the student: ``[B, P + N]`` ids, the student's top-k ids per
    position (``[B, P + N, k]`` int32, 0 where no sampled token follows), the positions that
    predict a sampled token (``mask``, ``[B, P + N]``), and the student's ``log q`` of each sampled
    token at those positions (0 elsewhere)."""

    input_ids: Tensor
    score_ids: Tensor
    mask: Tensor
    student_logprobs: Tensor

    def batch(self) -> dict[str, Tensor]:
        """What the reader sends: the ids (no padding: every row has ``P + N`` tokens) and SCORE_IDS."""
        return {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids),
                "score_ids": self.score_ids}

    @property
    def tokens(self) -> int:
        """Teacher-scored positions: those that predict a sampled token."""
        return int(self.mask.sum())


@torch.no_grad()
def sample(model: nn.Module, prompts: Tensor, new_tokens: int, *, k: int, generator: torch.Generator,
           temperature: float = 1.0) -> Rollout:
    """Continue ``prompts`` ``[B, P]`` by ``new_tokens`` tokens sampled from ``model`` (KV cache).

    Runs on the caller's thread, in eval mode (restored after), so it never races an optimizer.
    """
    if new_tokens < 1 or prompts.shape[1] < 1:
        raise ValueError(f"need prompts of >= 1 token and new_tokens >= 1, got {tuple(prompts.shape)}, {new_tokens}")
    was_training = model.training
    model.eval()
    b, p = prompts.shape
    total = p + new_tokens
    ids = torch.zeros((b, total), dtype=torch.long)
    ids[:, :p] = prompts
    score_ids = torch.zeros((b, total, k), dtype=torch.int32)
    logq = torch.zeros((b, total))
    mask = torch.zeros((b, total), dtype=torch.long)
    # transformers 5 names the KV cache ``cache``, 4.x ``past_key_values``.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompts, use_cache=True)
    for j in range(new_tokens):
        pos = p - 1 + j  # the position whose logits predict token pos + 1
        logprobs = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        ids[:, pos + 1] = nxt
        score_ids[:, pos] = logprobs.topk(k, dim=-1).indices.to(torch.int32)
        logq[:, pos] = logprobs.gather(-1, nxt[:, None]).squeeze(-1)
        mask[:, pos] = 1
        if j + 1 < new_tokens:
            cache = out.cache if cache_kw == "cache" else out.past_key_values
            out = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache})
    model.train(was_training)
    return Rollout(ids, score_ids, mask, logq)


@torch.no_grad()
def text_rollout(model: nn.Module, texts: Tensor, prompt_tokens: int, *, k: int) -> Rollout:
    """Training text ``[B, P + N]`` as a ``Rollout``: the text's own last ``N`` tokens stand where
    ``sample`` puts sampled ones, with the student's top-``k`` ids and its ``log q`` of each text token
    at the positions that predict them. GKD's steps on the fixed data (``lambda`` < 1): the same
    scoring and the same divergence, on contexts the student did not write."""
    b, total = texts.shape
    if not 1 <= prompt_tokens < total:
        raise ValueError(f"need 1 <= prompt_tokens < the texts' {total} tokens, got {prompt_tokens}")
    was_training = model.training
    model.eval()
    logprobs = torch.log_softmax(model(input_ids=texts).logits.float(), dim=-1)
    model.train(was_training)
    span = slice(prompt_tokens - 1, total - 1)  # the positions whose logits predict a text token after the prompt
    mask = torch.zeros((b, total), dtype=torch.long)
    mask[:, span] = 1
    score_ids = torch.zeros((b, total, k), dtype=torch.int32)
    score_ids[:, span] = logprobs[:, span].topk(k, dim=-1).indices.to(torch.int32)
    logq = torch.zeros((b, total))
    logq[:, span] = logprobs[:, span].gather(-1, texts[:, prompt_tokens:, None]).squeeze(-1)
    return Rollout(texts.clone(), score_ids, mask, logq)


def prompts_from(sequences: Sequence[list[int]], indices: Sequence[int], length: int) -> Tensor:
    """The first ``length`` tokens of each chosen sequence (each must have that many)."""
    return torch.tensor([sequences[i][:length] for i in indices], dtype=torch.long)


def support(rollout: Rollout, outputs: dict[str, Tensor], output: str = OUTPUT) -> ScoredTargets:
    """The teacher's log-probabilities on the union of the student's top-k (``SCORE_IDS``), the
    teacher's top-k and the sampled token, per position (``[B, T, 2k + 1]``)."""
    nxt = torch.full_like(rollout.input_ids, -1)
    nxt[:, :-1] = rollout.input_ids[:, 1:]
    return ScoredTargets.union(
        (rollout.score_ids, outputs[f"{output}_SCORED_LOGPROBS"]),
        (outputs[f"{output}_TOPK_INDICES"], outputs[f"{output}_TOPK_VALUES"]),
        (nxt.unsqueeze(-1), outputs[f"{output}_TOKEN_LOGPROBS"].unsqueeze(-1)))


def on_policy_loss(loss_fn: TokenKDLoss, logits: Tensor, rollout: Rollout, outputs: dict[str, Tensor]) -> Tensor:
    """``loss_fn`` (a reverse-KL ``TokenKDLoss`` with ``alpha=0``) over the positions that predict
    a sampled token; the logits at ``t`` are aligned with the teacher's outputs at ``t`` (no shift)."""
    return loss_fn(logits, support(rollout, outputs), attention_mask=rollout.mask)


@dataclass(frozen=True)
class SampleNLL:
    """Per-token NLL of the student's own held-out samples: under the teacher and under the student."""

    teacher_nll: float
    student_nll: float
    tokens: int

    @property
    def reverse_kl(self) -> float:
        """``mean(log q - log p)`` over the sampled tokens: a one-sample estimate of ``KL(q ‖ p)``."""
        return self.teacher_nll - self.student_nll


def teacher_nll(model: nn.Module, reader: Scorer, prompts: Tensor, new_tokens: int, *, seed: int,
                batch_size: int = 16) -> SampleNLL:
    """Sample ``new_tokens`` after each prompt from ``model`` (seeded), score them with the teacher
    through ``reader`` (``reader_options(scoring=False)``), and average the NLLs per sampled token."""
    gen = torch.Generator().manual_seed(seed)
    t_sum = s_sum = 0.0
    count = 0
    for start in range(0, prompts.shape[0], batch_size):
        r = sample(model, prompts[start:start + batch_size], new_tokens, k=1, generator=gen)
        outputs = reader.score({"input_ids": r.input_ids, "attention_mask": torch.ones_like(r.input_ids)})
        valid = r.mask.bool()
        t_sum -= float(outputs[f"{OUTPUT}_TOKEN_LOGPROBS"].float()[valid].sum())
        s_sum -= float(r.student_logprobs[valid].sum())
        count += int(valid.sum())
    if count == 0:
        raise ValueError("no held-out prompts to sample from")
    return SampleNLL(t_sum / count, s_sum / count, count)
