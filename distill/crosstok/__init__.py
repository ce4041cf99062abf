"""Cross-tokenizer distillation, the student's side: a teacher scores texts in its own tokens and
returns each token's byte span; the student tokenizes the same texts with spans (`SpanTokenizer`),
aligns the two tokenizations by bytes into chunks (`align`), maps the two vocabularies by the bytes
their entries stand for (`VocabMap`; the teacher's pieces fetched from it by `fetch_vocab_pieces`),
and applies the published losses: GOLD's matched-vocabulary divergence where both sides took the
same one-token step, ULD's sorted-probability distance elsewhere (`CrossTokenizerLoss`), and the
sampled-token form for on-policy training (`chunk_log_ratio`, `chunk_pg_loss`; `OnPolicyScorer`
sends a student's samples as text and aligns the answer by the sampled tokens' own bytes). The guide
is docs/guides/cross-tokenizer.md.
"""

from __future__ import annotations

from distill.crosstok.align import Alignment, align, chunk_sums
from distill.crosstok.gold import gold_chunks, matched_rows
from distill.crosstok.loss import ChunkLosses, CrossTokenizerLoss
from distill.crosstok.on_policy import (
    OnPolicyScorer,
    OnPolicyTargets,
    PendingTargets,
    SampledTexts,
    SamplesRefusedError,
    SampleTextError,
    sampled_texts,
)
from distill.crosstok.sampled import chunk_log_ratio, chunk_pg_loss, teacher_chunk_logprobs
from distill.crosstok.spans import SpanTokenizer, TextTokens
from distill.crosstok.teacher import TeacherText
from distill.crosstok.teacher_vocab import fetch_vocab_pieces
from distill.crosstok.uld import sorted_l1_rows
from distill.crosstok.vocab import VocabMap

__all__ = [
    "Alignment",
    "ChunkLosses",
    "CrossTokenizerLoss",
    "OnPolicyScorer",
    "OnPolicyTargets",
    "PendingTargets",
    "SampleTextError",
    "SampledTexts",
    "SamplesRefusedError",
    "SpanTokenizer",
    "TeacherText",
    "TextTokens",
    "VocabMap",
    "align",
    "chunk_log_ratio",
    "chunk_pg_loss",
    "chunk_sums",
    "fetch_vocab_pieces",
    "gold_chunks",
    "matched_rows",
    "sampled_texts",
    "sorted_l1_rows",
    "teacher_chunk_logprobs",
]
