"""``distill-demo``: run the demo (``examples/demo.py``) from a source checkout.

Why a launcher and not the demo itself: the wheel does not install ``examples`` (a top-level
package of that name in site-packages would collide with any other project's ``examples``; see
docs/getting-started/install.md), but the demo trains and serves the example models that live
there, and its teacher-servers import them by name (``--model examples.cv.teacher:build``). So
this command finds the checkout (the one this package was installed from in editable mode, as
``make demo`` does, or the current directory) and runs ``python -m examples.demo`` from it, with
the checkout first on ``PYTHONPATH`` for every process the demo starts. Without a checkout it says
how to get one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["find_checkout", "main"]


def find_checkout(*candidates: Path) -> Path | None:
    """The first of ``candidates`` that is a distill-mesh checkout (it has ``examples/demo.py``)."""
    for root in candidates:
        if (root / "examples" / "demo.py").is_file() and (root / "distill" / "__init__.py").is_file():
            return root.resolve()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Replace this process with ``python -m examples.demo ARGS`` run from the checkout."""
    root = find_checkout(Path(__file__).resolve().parent.parent, Path.cwd())
    if root is None:
        print("distill-demo: the demo runs from a source checkout of distill-mesh (the installed package "
              "does not include examples/). Clone the repository and run `make demo` in it, or run "
              "distill-demo from inside the checkout.", file=sys.stderr)
        return 2
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    args = list(sys.argv[1:] if argv is None else argv)
    os.execve(sys.executable, [sys.executable, "-m", "examples.demo", *args], env)
    return 0  # not reached: execve replaces the process


if __name__ == "__main__":
    sys.exit(main())
