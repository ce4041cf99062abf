"""The on-policy arm: a warm-started student samples, a teacher of another tokenizer scores the samples
as text, and the student learns from its own samples beside the corpus's hard labels.

The arm runs the same ``--steps`` over the same batches as the others, in two parts:

1. **Warm-up** (the first ``round(warmup · steps)`` steps): exactly the ``crosstok_kd`` arm
   (``examples.crosstok.kd``): the batch's texts through the mesh, GOLD + ULD on the aligned chunks,
   ``alpha · CE + (1 - alpha) · crosstok``. On-policy distillation helps a student whose samples
   are already text the teacher can grade; a fresh student's samples are byte noise, and their
   log-ratios say little.
2. **On-policy** (the rest): per step, the batch's pieces whose text has at least ``prompt_tokens``
   student tokens give a prompt each (the BOS and the piece's first ``prompt_tokens - 1`` tokens);
   the student continues them by ``new_tokens`` tokens sampled from its own distribution
   (temperature 1, a KV cache, ``examples.llm.onpolicy.sample``, the generator seeded by the run's
   seed, so the samples repeat), on the training thread from the weights the step updates
   (staleness 0). ``distill.crosstok.OnPolicyScorer`` sends the samples as text (each row the sampled
   tokens' own pieces joined) through a ``DistillReader(None, inputs=["TEXT"])`` on the same mesh; the
   teacher scores them in its own tokens and the answer is aligned to the *sampled* tokens by bytes.
   The loss is ``alpha · CE + (1 - alpha) · (PG + KD)``:

   * ``CE``: the batch's hard labels, as in every arm, so the student keeps learning the corpus
     (the samples are the student's own text: without the corpus term it learns only to please the
     teacher on what it already writes, and drifts);
   * ``PG``: ``chunk_pg_loss``, the sampled-token reverse-KL policy gradient: each chunk's
     ``-(log q - log p)`` spread over its student tokens, as the advantage of ``log q`` of each;
   * ``KD``: ``CrossTokenizerLoss`` (GOLD + ULD on the teacher's top-k) on the same aligned chunks of
     the continuation, which the alignment gives for free and which is dense where PG is one sample.

   Prompt tokens are context only: a chunk counts when all its student tokens were sampled. A step
   whose batch has no piece long enough, or whose texts the teacher refuses, trains on ``CE`` alone.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from distill import DistillReader
from distill.crosstok import OnPolicyScorer, OnPolicyTargets, SamplesRefusedError
from examples.crosstok.kd import CrossTokenizerKD
from examples.crosstok.mesh import OUTPUT
from examples.crosstok.train import Batch, next_token_ce
from examples.llm.onpolicy import sample


@dataclass(frozen=True)
class OnPolicySettings:
    """The arm's own settings: the warm-up's share of the steps, the prompt's length in student tokens
    (the BOS included) and the number of sampled tokens per prompt."""

    warmup: float = 0.8
    prompt_tokens: int = 16
    new_tokens: int = 48

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup must be a share of the steps in [0, 1), got {self.warmup}")
        if self.prompt_tokens < 2 or self.new_tokens < 1:
            raise ValueError(f"need prompt_tokens >= 2 (the BOS and one text token) and new_tokens >= 1, got "
                             f"{self.prompt_tokens}, {self.new_tokens}")

    def warmup_steps(self, steps: int) -> int:
        return round(self.warmup * steps)


@dataclass
class Counts:
    """What the on-policy part did: its steps, the steps the teacher scored, the sampled rows it
    scored, the continuation chunks counted, and the steps refused or without a long enough piece."""

    steps: int = 0
    scored_steps: int = 0
    scored_rows: int = 0
    counted_chunks: int = 0
    refused: int = 0
    no_prompt: int = 0
    kl: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """For the results JSON; ``sample_kl_first``/``_last``: the mean over the first and the last tenth
        of the scored steps of the per-token estimate of ``KL(q ‖ p)`` on the samples (``mean(log q -
        log p)`` over the counted student tokens), None without scored steps."""
        tenth = max(1, len(self.kl) // 10)
        return {"onpolicy_steps": self.steps, "scored_steps": self.scored_steps, "scored_rows": self.scored_rows,
                "counted_chunks": self.counted_chunks, "refused_steps": self.refused,
                "no_prompt_steps": self.no_prompt,
                "sample_kl_first": statistics.fmean(self.kl[:tenth]) if self.kl else None,
                "sample_kl_last": statistics.fmean(self.kl[-tenth:]) if self.kl else None}


def prompts_of(batch: Batch, prompt_tokens: int) -> Tensor:
    """``[B', prompt_tokens]``: the first ``prompt_tokens`` ids (BOS included) of each piece that has
    more tokens than that (right padding: a shorter piece would put padding in its prompt)."""
    long_enough = batch["attention_mask"].sum(dim=1) > prompt_tokens
    return batch["input_ids"][long_enough, :prompt_tokens]


class OnPolicyKD:
    """The arm's pairs and loss: ``crosstok`` (the off-policy arm's pieces) for the warm-up, then
    samples of ``model`` scored through ``crosstok``'s mesh."""

    def __init__(self, model: nn.Module, crosstok: CrossTokenizerKD, tokenizer: Any, settings: OnPolicySettings, *,
                 seed: int) -> None:
        self.model, self.crosstok, self.settings = model, crosstok, settings
        self.tokenizer = tokenizer
        self.generator = torch.Generator().manual_seed(seed)
        self.counts = Counts()

    @contextlib.contextmanager
    def pairs(self, loader: Sequence[Batch]) -> Iterator[Iterator[tuple[Batch, Any]]]:
        """``(batch, outputs)`` for every batch of ``loader``: the warm-up's from an off-policy reader,
        the rest's ``OnPolicyTargets`` (or None) from samples taken when the loop asks for the pair."""
        warm = self.settings.warmup_steps(len(loader))
        options = self.crosstok.reader_options()
        with contextlib.ExitStack() as stack:
            offline = stack.enter_context(DistillReader(self.crosstok.prepare(loader[:warm]), **options)) \
                if warm else ()
            scorer = OnPolicyScorer(stack.enter_context(DistillReader(None, **options)), self.tokenizer,
                                    output=OUTPUT)
            yield self._pairs(offline, scorer, loader[warm:])

    def _pairs(self, offline: Any, scorer: OnPolicyScorer, rest: Sequence[Batch]) -> Iterator[tuple[Batch, Any]]:
        yield from offline
        for batch in rest:
            yield batch, self._targets(scorer, batch)

    def _targets(self, scorer: OnPolicyScorer, batch: Batch) -> OnPolicyTargets | None:
        self.counts.steps += 1
        prompts = prompts_of(batch, self.settings.prompt_tokens)
        if prompts.shape[0] == 0:
            self.counts.no_prompt += 1
            return None
        rollout = sample(self.model, prompts, self.settings.new_tokens, k=1, generator=self.generator)
        try:
            targets = scorer.score(rollout.input_ids, prompt_length=self.settings.prompt_tokens,
                                   deadline_s=self.crosstok.timeout)
        except SamplesRefusedError:
            self.counts.refused += 1
            return None
        self.counts.scored_steps += 1
        self.counts.scored_rows += len(targets.samples.texts)
        self.counts.counted_chunks += int(targets.counted.sum())
        return targets

    def loss(self, logits: Tensor, batch: Batch, outputs: Any) -> Tensor:
        """The warm-up's loss for its pairs; ``alpha · CE + (1 - alpha) · (PG + KD)`` for scored samples;
        the plain CE for a step without them."""
        if not isinstance(outputs, OnPolicyTargets):
            return self.crosstok.loss(logits, batch, outputs)
        ce = next_token_ce(logits, batch)
        ids = outputs.samples.tokens.ids
        sampled = self.model(input_ids=ids, attention_mask=outputs.samples.tokens.mask.long()).logits
        temperature = self.crosstok.temperature
        ratio, keep = outputs.log_ratio(sampled, temperature=temperature)
        self.counts.kl.append(float(ratio.detach()[keep].sum() / keep.sum().clamp(min=1)))
        pg = outputs.pg_loss(sampled, temperature=temperature)
        kd = outputs.kd_loss(sampled, self.crosstok.loss_fn)
        return self.crosstok.alpha * ce + (1.0 - self.crosstok.alpha) * (pg + kd)
