"""`teacher-server`'s process entry (`teacher_server.entry`): the OpenMP wait policy is passive
unless the environment chose one, set before torch loads. The real command runs with a model that
refuses to load and names the policy its process has, so nothing is served."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from teacher_server.entry import apply_process_defaults
from tests.servers import REPO


def _policy_seen(**env: str) -> str:
    """The OMP_WAIT_POLICY a `python -m teacher_server` process had, with `env` added to a
    parent environment that sets neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-m", "teacher_server", "--model", "tests.models:omp_wait_policy",
                           "--name", "probe", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False, env={**base, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode != 0, "the probe model must refuse to load"
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "OMP_WAIT_POLICY=" in line]
    assert lines, proc.stdout + proc.stderr
    return lines[-1].rsplit("OMP_WAIT_POLICY=", 1)[1].strip()


def test_a_teacher_process_waits_passively_unless_its_environment_chose_a_policy() -> None:
    assert _policy_seen() == "PASSIVE"
    assert _policy_seen(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert _policy_seen(GOMP_SPINCOUNT="300000") == "<unset>"  # a spin count is a choice too


@pytest.mark.parametrize(("environ", "applied"), [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {}),
    ({"GOMP_SPINCOUNT": "10000"}, {}),
])
def test_defaults_fill_only_what_the_environment_leaves_unset(environ: dict[str, str],
                                                              applied: dict[str, str]) -> None:
    given = dict(environ)
    assert apply_process_defaults(given) == applied
    assert given == {**environ, **applied}


def test_the_console_script_runs_the_entry_that_sets_the_defaults() -> None:
    (script,) = entry_points(group="console_scripts", name="teacher-server")
    assert script.value == "teacher_server.entry:main"
