"""glibc malloc's thresholds fixed for the serving process (`teacher_server.malloc_tuning`).

Real glibc, real processes: a thread that allocates and frees a batch's worth of memory in turn
faults it in again every time under glibc's defaults and not once tuned; a real teacher-server
tunes it unless started with --no-malloc-tuning; an allocator configured from outside the process
is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg

from teacher_server.cli import build_parser, serve_options
from teacher_server.launch import TeacherProcess
from teacher_server.malloc_tuning import OUTSIDE_SETTINGS, glibc_version, tune_malloc
from tests.servers import REPO

pytestmark = pytest.mark.skipif(glibc_version() is None, reason="glibc's allocator only (Linux; CI runs it)")

# A worker thread allocates three 8 MiB buffers, writes them, frees them, 12 times; the page
# faults of the last 10 rounds, per round, as JSON.
ROUNDS = """
import json, resource, sys, threading
import numpy as np
if sys.argv[1] == "tuned":
    from teacher_server.malloc_tuning import tune_malloc
    assert tune_malloc().applied
out = []
def rounds():
    for i in range(12):
        if i == 2:
            start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        bufs = [np.ones(2 << 20, dtype=np.float32) for _ in range(3)]
        del bufs
    out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start) / 10)
t = threading.Thread(target=rounds)
t.start()
t.join()
print(json.dumps(out[0]))
"""


def _faults_a_round(mode: str) -> float:
    proc = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True, env={**_clean_env(), "PYTHONPATH": str(REPO)})
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (*OUTSIDE_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD"):
        env.pop(name, None)
    return env


def test_tuned_memory_freed_after_a_round_is_not_faulted_in_again() -> None:
    default = _faults_a_round("default")
    tuned = _faults_a_round("tuned")
    # 24 MiB written a round is 6,144 pages: glibc's defaults give most of them back and fault
    # them in again (about 1,500 a round here); tuned, the heap keeps them.
    assert default > 500, default
    assert tuned < default / 20, (tuned, default)


OUTSIDE = {**{name: "1" for name in OUTSIDE_SETTINGS}, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1",
           "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}


@pytest.mark.parametrize("outside", OUTSIDE)
def test_an_allocator_configured_from_outside_is_left_alone(outside: str) -> None:
    tuning = tune_malloc({outside: OUTSIDE[outside]})
    assert not tuning.applied
    assert outside in tuning.detail


@pytest.mark.parametrize(("name", "value"), [("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
                                             ("LD_PRELOAD", "libz.so.1")])
def test_settings_that_are_not_the_allocators_do_not_stop_it(name: str, value: str) -> None:
    """GLIBC_TUNABLES without malloc settings, or a preloaded library that is not an allocator,
    leaves malloc to us; checked in a process of its own, since it applies the settings (the
    variable is set once the process runs: only the check reads it)."""
    code = (f"import os; os.environ[{name!r}] = {value!r}; "
            "from teacher_server.malloc_tuning import tune_malloc; print(tune_malloc().applied)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True, env={**_clean_env(), "PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "True"


def test_the_flag_turns_it_off_and_it_is_on_by_default() -> None:
    parser = build_parser()
    base = ["--model", "tests.models:affine"]
    assert serve_options(parser.parse_args(base))["malloc_tuning"] is True
    assert serve_options(parser.parse_args([*base, "--no-malloc-tuning"]))["malloc_tuning"] is False


def _log_of(tmp_path: Path, extra: list[str]) -> str:
    """The log of a teacher-server that started and answered a request."""
    log = tmp_path / f"teacher{len(extra)}.log"
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1", *extra]
    with TeacherProcess(args, cwd=REPO, env={**_clean_env(), "PYTHONPATH": str(REPO)}, log=log,
                        ready_timeout=120, stop_grace=10) as proc:
        client = tg.InferenceServerClient(proc.endpoint)
        try:
            x = tg.InferInput("X", [2, 8], "FP32")
            x.set_data_from_numpy(np.ones((2, 8), dtype=np.float32))
            assert client.infer("affine", [x]).as_numpy("Y").shape == (2, 4)
        finally:
            client.close()
    return log.read_text()


def test_a_teacher_server_tunes_malloc_unless_told_not_to(tmp_path: Path) -> None:
    """The process applies `tune_malloc` (the function the rounds above measure) and says so once,
    with the flag that turns it off; with that flag it leaves glibc's defaults and says nothing."""
    tuned = _log_of(tmp_path, [])
    assert tuned.count("malloc: glibc") == 1 and "--no-malloc-tuning" in tuned, tuned
    default = _log_of(tmp_path, ["--no-malloc-tuning"])
    assert "malloc:" not in default, default
