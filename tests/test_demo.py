"""`make demo` in its fast form: it serves, answers correctly, measures, and leaves no process behind."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.servers import REPO


def test_demo_runs_end_to_end() -> None:
    out = subprocess.run([sys.executable, "-m", "examples.demo", "--seconds", "1", "--batch", "64"], cwd=REPO,
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    assert "max |server - in-process| = 0.00e+00" in out.stdout, out.stdout
    assert re.search(r"throughput at batch 64: [\d,]+ samples/s", out.stdout), out.stdout
    assert "teacher-server stopped" in out.stdout
    leftovers = subprocess.run(["pgrep", "-f", "teacher_server --port 0 --ready-file .*distill-demo-"], check=False,
                               capture_output=True, text=True)
    assert leftovers.stdout == "", f"demo left a teacher-server running: {leftovers.stdout}"
