"""The documentation is part of the product: its reference pages match the declarations, and the
code blocks it says run, run.

A fenced code block right after the line ``<!-- runs -->`` (in README.md or any page under docs/)
is run as it stands: ``bash`` blocks by bash in the repository's root with the virtualenv's
``bin`` first on PATH, ``python`` blocks by this interpreter. ``mkdocs build --strict`` itself runs
in ``make test`` (``make docs-check``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import gen_reference  # noqa: E402

RUNS = re.compile(r"^<!-- runs -->\n```(bash|python)\n(.*?)^```", re.M | re.S)


def _marked_blocks() -> list[tuple[str, str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, m in enumerate(RUNS.finditer(path.read_text())):
            out.append((f"{path.relative_to(ROOT)}#{i}", m.group(1), m.group(2)))
    return out


def test_the_reference_pages_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in gen_reference.pages().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"{stale} differ from the declarations: run `make docs` and commit the pages"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    out = {s for a in parser._actions for s in a.option_strings if a.help is not argparse.SUPPRESS}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _flags(sub)
    return out - {"-h", "--help"}


@pytest.mark.parametrize("page", sorted(gen_reference.COMMANDS))
def test_every_flag_is_on_its_page(page: str) -> None:
    _, build = gen_reference.COMMANDS[page]
    text = (gen_reference.OUT / page).read_text()
    missing = sorted(f for f in _flags(build()) if f"`{f}" not in text)
    assert not missing, f"flags missing from docs/reference/{page}: {missing}"


def test_every_reader_option_and_flag_is_on_its_page() -> None:
    from distill.declare import declared
    from distill.flags import add_distill_args
    from distill.options import ReaderOptions

    text = (gen_reference.OUT / "reader-options.md").read_text()
    names = [d.name for d in declared(ReaderOptions)]
    assert len(names) > 20
    assert not [n for n in names if f"| `{n}` |" not in text]
    flags = _flags(add_distill_args(argparse.ArgumentParser()))
    assert flags and not [f for f in flags if f"`{f}`" not in text and f"`--no-{f[2:]}`" not in text]


def test_the_generator_notices_a_new_flag(tmp_path: Path) -> None:
    p = argparse.ArgumentParser(prog="x", description="A tool.")
    p.add_argument("--alpha", type=int, default=3, help="how much (%(default)s)")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("go", description="Go.").add_argument("--beta", action="store_true", help="b|c")
    page = gen_reference.parser_page(p)
    assert "| `--alpha ALPHA` | `3` | how much (3) |" in page
    assert "## `x go`" in page and "| `--beta` | off | b\\|c |" in page


def test_marked_blocks_exist() -> None:
    assert _marked_blocks(), "no code block is marked `<!-- runs -->`: the docs' examples go untested"


@pytest.mark.parametrize("name,lang,code", _marked_blocks(), ids=lambda v: v if isinstance(v, str) and "#" in v else "")
def test_marked_block_runs(name: str, lang: str, code: str) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
