"""The cross-tokenizer arm: the teacher's answer for a batch's texts, aligned to the student's tokens by
bytes, and ``distill.crosstok``'s losses on it.

Per batch: ``DistillReader(..., inputs=["TEXT"])`` sends the texts (the batch field ``TEXT``); the
teacher server tokenizes them with its own tokenizer and answers ``TEXT_IDS``, ``TEXT_SPANS``,
``TEXT_MASK``, its top-k log-probabilities with the tail and its token log-probabilities (the text
contract, docs/guides/cross-tokenizer.md). The student's side of every batch is tokenized once,
before training, with byte spans by the same rule (``distill.crosstok.SpanTokenizer``); the two are
aligned into chunks and ``distill.crosstok.CrossTokenizerLoss`` applies GOLD's matched-vocabulary
forward KL on the chunks that are one token of the same piece on each side and ULD's
sorted-probability distance on the others. The vocabulary map is built once, from the student's
pieces and the teacher's as the teacher itself sends them (``VOCAB_IDS`` → ``VOCAB_PIECES``).

The arm's loss is ``alpha · CE + (1 - alpha) · crosstok``: the student's own next-token
cross-entropy (as every arm has) plus the cross-tokenizer loss averaged over the counted chunks.
The temperature softens the student in the cross-tokenizer loss; unlike ``TokenKDLoss`` no ``T²``
scales it (ULD's distance is not a KL), so the default ``T = 1`` is where the KD arms compare alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerFast

from distill.crosstok import CrossTokenizerLoss, SpanTokenizer, TeacherText, VocabMap, fetch_vocab_pieces
from examples.crosstok.corpus import TEXT
from examples.crosstok.mesh import OUTPUT, Mesh, topk_options
from examples.crosstok.train import Batch, next_token_ce
from examples.llm.mesh import MODEL_NAME
from protos.text import TEXT_IDS, TEXT_MASK, TEXT_SPANS

STUDENT = "student_tokens"
"""The batch field holding the student's ``TextTokens`` (ids, byte spans, mask) of the batch's texts."""


class CrossTokenizerKD:
    """The arm's reader keywords, its batches' student side and its loss, for the teacher of ``mesh``.

    The teacher's vocabulary pieces are fetched from its server on construction (``timeout`` is
    that call's deadline, and each chunk's at the teacher).
    """

    def __init__(self, student_tokenizer: PreTrainedTokenizerFast, mesh: Mesh, *, k: int, temperature: float,
                 alpha: float, timeout: float) -> None:
        self.mesh, self.k, self.temperature, self.alpha, self.timeout = mesh, k, temperature, alpha, timeout
        self.tokens = SpanTokenizer(student_tokenizer)
        teacher_pieces = fetch_vocab_pieces(mesh.endpoint, MODEL_NAME, output=OUTPUT, timeout=timeout)
        self.vocab = VocabMap.from_pieces(self.tokens.pieces, teacher_pieces)
        self.loss_fn = CrossTokenizerLoss(self.vocab, temperature=temperature)

    def reader_options(self) -> dict[str, Any]:
        """``DistillReader`` keywords: the texts in; the text outputs, the top-k with the tail and the
        token log-probabilities (ULD scales a chunk of several teacher tokens by them) out."""
        return {**self.mesh.reader_location(), "inputs": [TEXT], "outputs": [TEXT_IDS, TEXT_SPANS, TEXT_MASK, OUTPUT],
                **topk_options(k=self.k, temperature=self.temperature), "token_logprobs": True,
                "timeout": self.timeout}

    def prepare(self, batches: Iterable[Batch]) -> list[Batch]:
        """Each batch with its student ``TextTokens`` (``STUDENT``); their ids are the batch's
        ``input_ids`` (the same tokenizer, right-padded), which the check below holds to."""
        out = []
        for batch in batches:
            tokens = self.tokens(batch[TEXT])
            if not tokens.ids.equal(batch["input_ids"]):
                raise ValueError("the span tokenizer's ids differ from the batch's input_ids: the arm's batches "
                                 "must be collated with the student's tokenizer, padded on the right")
            out.append({**batch, STUDENT: tokens})
        return out

    def loss(self, logits: Tensor, batch: Batch, outputs: Mapping[str, Tensor] | None) -> Tensor:
        """``alpha · CE + (1 - alpha) · CrossTokenizerLoss``; the plain CE for a batch no teacher answered."""
        ce = next_token_ce(logits, batch)
        if outputs is None:
            return ce
        teacher = TeacherText.from_outputs(outputs, OUTPUT)
        return self.alpha * ce + (1.0 - self.alpha) * self.loss_fn(logits, batch[STUDENT], teacher)
