"""CV example: distil a CNN teacher into a small MLP on scikit-learn's 8x8 digits, through the mesh.

Scripts (each ``python -m examples.cv.<name> --help``): ``train_teacher``, ``export``, ``serve``,
``train_student``. The pieces are importable for other programs (``make demo`` reuses them):
``data`` (the fixed split, augmented batches), ``models``, ``teacher`` (``build`` for
``teacher-server --model examples.cv.teacher:build``); ``examples.common`` (cache dir, results,
a teacher-server subprocess that always stops) is shared with the NLP example.
See README.md for commands and measured results.
"""
