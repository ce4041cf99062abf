"""`make demo` in its fast form: it trains, distils through an autoscaled pool, prints the table,
writes the plot, and leaves no process behind (nor when it overruns)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import REPO


def _run_demo(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The demo in a session of its own: past `timeout` its whole process group (the demo, its etcd
    and its autoscaler) gets SIGTERM, then SIGKILL, so a demo that overran leaves nothing running."""
    proc = subprocess.Popen([sys.executable, "-m", "examples.demo", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the demo did not finish within {timeout:g} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(360)  # past the demo's own 300 s, so an overrun ends in its cleanup, not pytest's
def test_demo_distils_end_to_end_and_cleans_up(tmp_path: Path) -> None:
    env = {**os.environ, "DISTILL_MESH_CACHE": str(tmp_path / "cache")}
    # One student epoch each (KD, no KD): what the table, the plot and the 0 -> 1 -> 0 pool need.
    out = _run_demo(["--fast", "--epochs", "1", "--out", str(tmp_path / "out")], env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "training the teacher on scikit-learn's digits" in text  # nothing cached: it trained one
    for row in ("teacher (CNN", "student MLP, with KD (mesh)", "student MLP, without KD", "KD gain:"):
        assert row in text, text
    assert re.search(r"student MLP, with KD \(mesh\)\s+\d+\.\d%\s+[\d,]+\s+\d+\.\d%\s+1", text), text
    assert re.search(r"teachers over time: 0 \(t=\d+s\) -> 1 \(t=\d+s\) -> 0", text), text  # 0 -> 1 -> 0
    assert "autoscaler: scale up 0 -> 1" in out.stdout + out.stderr
    results = json.loads((tmp_path / "out" / "distill-demo.json").read_text())
    assert results["kd"][0]["samples"] > 0 and results["no_kd"][0]["samples"] > 0
    assert (tmp_path / "out" / "distill-demo.png").stat().st_size > 10_000
    leftovers = subprocess.run(["pgrep", "-f", f"{tmp_path}|distill-demo-|demo-digits"], capture_output=True,
                               text=True, check=False)
    assert leftovers.stdout == "", f"the demo left processes behind: {leftovers.stdout}"
