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

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerFast

from examples.crosstok.corpus import TEXT
from examples.crosstok.train import Batch, next_token_ce
from examples.llm import mesh

OUTPUT = "LOGITS"
TEXT_OUTPUTS = ("TEXT_IDS", "TEXT_SPANS", "TEXT_MASK")
STUDENT = "student_tokens"
"""The batch field holding the student's ``TextTokens`` (ids, byte spans, mask) of the batch's texts."""

_NEEDS = {"distill.crosstok": ("CrossTokenizerLoss", "SpanTokenizer", "TeacherText", "VocabMap")}


def missing() -> str | None:
    """Why the cross-tokenizer arm cannot run in this tree (None when it can): the student side's
    alignment and losses (``distill.crosstok``) and a reader that sends text fields."""
    for module, names in _NEEDS.items():
        try:
            found = importlib.import_module(module)
        except ImportError as e:
            return f"{module} cannot be imported ({e})"
        absent = [n for n in names if not callable(getattr(found, n, None))]
        if absent:
            return f"{module} lacks {', '.join(absent)}"
    from distill.batches import extract_inputs

    try:
        extract_inputs({TEXT: ["a text"]}, {TEXT: TEXT})
    except TypeError as e:
        return f"the reader cannot send a text field ({e})"
    return None


class CrossTokenizerKD:
    """The arm's reader keywords, its batches' student side and its loss, for one teacher server.

    ``teachers`` is the ``host:port`` of the server of ``examples.llm.mesh.serve_teacher``; the
    vocabulary map is fetched from it on construction (``timeout`` is that call's deadline too).
    """

    def __init__(self, student_tokenizer: PreTrainedTokenizerFast, teacher_tokenizer: PreTrainedTokenizerFast, *,
                 teachers: str, k: int, temperature: float, alpha: float, timeout: float) -> None:
        from distill.crosstok import CrossTokenizerLoss, SpanTokenizer, VocabMap
        from teacher_server.vocab_pieces import vocab_pieces

        self.teachers, self.k, self.temperature, self.alpha, self.timeout = teachers, k, temperature, alpha, timeout
        self.tokens = SpanTokenizer(student_tokenizer)
        teacher_pieces = vocab_pieces(teacher_tokenizer)
        self.vocab = VocabMap.from_pieces(self.tokens.pieces, teacher_pieces)
        self.loss_fn = CrossTokenizerLoss(self.vocab, temperature=temperature)

    def reader_options(self) -> dict[str, Any]:
        """``DistillReader`` keywords: the texts in, the text outputs and the top-k with tail and token
        log-probabilities out (float16 values, as the reference arm gets them)."""
        return {"inputs": [TEXT], "outputs": [*TEXT_OUTPUTS, OUTPUT], "teachers": self.teachers,
                "model": mesh.MODEL_NAME, "top_k": self.k, "logprobs": True, "topk_tail": True,
                "token_logprobs": True, "temperature": self.temperature, "output_dtype": "FP16",
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
        from distill.crosstok import TeacherText

        ce = next_token_ce(logits, batch)
        if outputs is None:
            return ce
        teacher = TeacherText.from_outputs(outputs, OUTPUT)
        return self.alpha * ce + (1.0 - self.alpha) * self.loss_fn(logits, batch[STUDENT], teacher)
