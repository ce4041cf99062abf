"""NLP example: distil a transformer teacher into a small CNN from top-k logits, on generated text.

Scripts (each ``python -m examples.nlp.<name> --help``): ``train_teacher``, ``export``, ``serve``,
``train_student``. ``data`` documents the seeded sentence generator. See README.md for commands
and measured results.
"""
