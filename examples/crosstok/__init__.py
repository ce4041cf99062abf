"""Cross-tokenizer distillation, measured: a teacher and a student with different tokenizers
(``python -m examples.crosstok``; see examples/crosstok/README.md)."""
