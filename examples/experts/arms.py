"""The student's four arms, each one ``train.fit`` over the same batches with the same step budget:

1. ``no KD``: cross-entropy on the reference answers.
2. ``generalist KD``: off-policy, the generalist's top-k log-probabilities (and tail) on the
   reference sequences, ``TokenKDLoss(alpha=ALPHA)`` (forward KL plus the answers' cross-entropy).
3. ``experts KD``: the same loss, each row's targets from its task's expert.
4. ``experts on-policy``: the student samples its own answers to the batch's prompts, each row's
   expert scores them, and the loss is the reverse KL on the union of the student's top-k, the
   expert's top-k and the sampled token (``examples.llm.onpolicy``, the project's on-policy path).

Every KD term counts the answer positions only: the prompts are random and there is nothing to
learn there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from distill import DistillReader
from distill.losses import TokenKDLoss
from examples.experts import mesh
from examples.experts.tasks import EOS, MAX_LEN, PAD
from examples.experts.train import StepLoss, answer_ce, fit
from examples.llm.onpolicy import Rollout, on_policy_loss
from examples.llm.student import targets_from_outputs

ARMS = ("no KD", "generalist KD", "experts KD", "experts on-policy")
ALPHA = 0.5  # off-policy KD: the weight of the answers' cross-entropy beside the forward KL
K = 8  # the teachers' top-k (of a 25-token vocabulary)


def offpolicy_loss() -> StepLoss:
    kd = TokenKDLoss(alpha=ALPHA)

    def loss(model: nn.Module, item: tuple[dict[str, Tensor], Mapping[str, Tensor]]) -> Tensor:
        batch, outputs = item
        return kd(model(batch["input_ids"]), targets_from_outputs(outputs), labels=batch["labels"])

    return loss


@torch.no_grad()
def rollout(model: nn.Module, batch: Mapping[str, Tensor], *, k: int, generator: torch.Generator) -> Rollout:
    """Each prompt of ``batch`` continued by the student's samples (temperature 1) until ``<eos>``
    or the longest problem's length, with the student's top-``k`` ids and ``log q`` at the
    positions that predict a sampled token. Runs on the training thread, in eval mode."""
    was_training = model.training
    model.eval()
    prompt_len = batch["prompt_len"]
    rows, positions = torch.arange(prompt_len.shape[0]), torch.arange(MAX_LEN)
    ids = torch.full((prompt_len.shape[0], MAX_LEN), PAD, dtype=torch.long)
    width = batch["input_ids"].shape[1]
    ids[:, :width] = torch.where(positions[:width] < prompt_len[:, None], batch["input_ids"], PAD)
    length = prompt_len.clone()
    done = torch.zeros_like(length, dtype=torch.bool)
    for _ in range(MAX_LEN):  # one token per row and round; every row is done after MAX_LEN rounds
        probs = torch.softmax(model(ids)[rows, length - 1].float(), dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        active = rows[~done]
        ids[active, length[active]] = token[active]
        length[active] += 1
        done |= (token == EOS) | (length >= MAX_LEN)
        if bool(done.all()):
            break
    logprobs = torch.log_softmax(model(ids).float(), dim=-1)
    model.train(was_training)
    mask = (positions >= prompt_len[:, None] - 1) & (positions < length[:, None] - 1)
    score_ids = torch.where(mask[..., None], logprobs.topk(k, dim=-1).indices, 0).to(torch.int32)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    logq = torch.where(mask, logprobs.gather(-1, nxt[..., None]).squeeze(-1), 0.0)
    return Rollout(ids, score_ids, mask.long(), logq)


def onpolicy_loss(scorer: DistillReader, *, seed: int) -> StepLoss:
    reverse_kl = TokenKDLoss("reverse_kl")
    generator = torch.Generator().manual_seed(seed)

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        r = rollout(model, batch, k=K, generator=generator)
        real = (torch.arange(MAX_LEN) < (r.mask.sum(1) + batch["prompt_len"])[:, None]).long()
        outputs = scorer.score({"input_ids": r.input_ids, "attention_mask": real, "score_ids": r.score_ids,
                                "task": batch["task"]})
        return on_policy_loss(reverse_kl, model(r.input_ids), r, outputs)

    return loss


def run(arm: str, student: nn.Module, batches: list[dict[str, Tensor]], endpoints: Mapping[str, str], *,
        lr: float, seed: int) -> list[float]:
    """Train ``student`` in place on ``batches`` as ``arm`` says; returns the losses per step."""
    experts = {task: endpoints[task] for task in mesh.ROUTE_MAP.values()}
    if arm == "no KD":
        return fit(student, batches, answer_ce, lr=lr)
    if arm == "generalist KD":
        return fit(student, mesh.single_pairs(batches, endpoints["generalist"], mesh.offpolicy_options(K)),
                   offpolicy_loss(), lr=lr)
    if arm == "experts KD":
        return fit(student, mesh.routed_pairs(batches, experts, mesh.offpolicy_options(K)), offpolicy_loss(), lr=lr)
    if arm == "experts on-policy":
        with mesh.routed_scorer(experts, mesh.onpolicy_options(K)) as scorer:
            return fit(student, batches, onpolicy_loss(scorer, seed=seed), lr=lr)
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
