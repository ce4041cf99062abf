"""What the wheel installs: the mesh's own packages and nothing with a generic name.

A wheel that put ``examples`` (or ``tests``, ``benchmarks``) into site-packages would collide with
any other project's package of that name. The wheel is built here from a copy of the checkout
(so no build output lands in it), without network (``--no-build-isolation``: the setuptools of
this environment), and its file list is read back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from distill.demo import find_checkout
from tests.servers import REPO

INSTALLED = {"distill", "teacher_server", "discovery", "protos"}


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "results", "*.pyc")
    for folder in (*INSTALLED, "examples", "tests", "benchmarks"):
        shutil.copytree(REPO / folder, src / folder, ignore=skip)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    [wheel] = (tmp_path / "dist").glob("distill_mesh-*.whl")
    return wheel


def test_the_wheel_installs_only_the_mesh_packages(tmp_path: Path) -> None:
    with zipfile.ZipFile(_build_wheel(tmp_path)) as whl:
        names = whl.namelist()
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = whl.read(entry_points).decode()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == INSTALLED, sorted(top)
    assert "protos/registry.proto" in names and "discovery/top/render.py" in names
    # Every command points into an installed package (distill-demo runs the examples from a checkout).
    targets = dict(line.split(" = ") for line in scripts.splitlines() if " = " in line)
    assert targets["distill-demo"] == "distill.demo:main", targets
    assert {t.split(".")[0].split(":")[0] for t in targets.values()} <= INSTALLED, targets


def test_distill_demo_finds_the_checkout_from_elsewhere(tmp_path: Path) -> None:
    assert find_checkout(tmp_path) is None
    assert find_checkout(tmp_path, REPO) == REPO.resolve()
    # Run from another directory: the launcher finds the checkout it was imported from and runs the demo.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "distill.demo", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--fast" in out.stdout, out.stdout
