"""`distill record` and `distill.cache.record`: a real teacher process, real `distill record` processes
(and, for a test's later runs, `distill record`'s entry point in the test process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

pytest.importorskip("pyarrow")

from discovery.local_etcd import LocalEtcd
from distill import DistillReader
from distill.cache import LoaderContractError, TeacherOutputStore, record
from distill.cache.recording import loader_from_module
from protos.kserve import service_pb2, service_pb2_grpc
from tests.etcd_fixtures import unique_service
from tests.faults.helpers import assert_delivered_once_in_order
from tests.models import Affine
from tests.servers import REPO, teacher_process

ROWS = 10

# A data set module in the `python -m MODULE [ARGS]` form: loader() reads its flags from sys.argv.
# With --hold-after N it writes READY_FILE after yielding N batches and then waits (bounded) for
# a file that never comes, so a test can kill the recording with batches in its store's writer.
DATA_MODULE = '''
import argparse, os, time
import torch

def loader():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--hold-after", type=int, default=-1)
    p.add_argument("--ready-file", default="")
    args = p.parse_args()
    def batches():
        for i in range(args.batches):
            if i == args.hold_after:
                open(args.ready_file, "w").close()
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    time.sleep(0.05)
            idx = torch.arange(i * 10, (i + 1) * 10)
            x = torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(int(k))) for k in idx])
            yield {"X": x, "index": idx, "tag": torch.full((10,), i)}
    return batches()
'''


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    """What DATA_MODULE's loader yields, built in this process."""
    out = []
    for i in range(n):
        idx = torch.arange(i * ROWS, (i + 1) * ROWS)
        x = torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(int(k))) for k in idx])
        out.append({"X": x, "index": idx, "tag": torch.full((ROWS,), i)})
    return out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `python -m teacher_server` process serving tests.models:affine; yields HOST:PORT."""
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1"]
    with teacher_process(args, tmp_path_factory.mktemp("teacher")) as (_, info):
        yield f"127.0.0.1:{info['port']}"


def _inference_count(url: str) -> int:
    """Samples the teacher itself says it inferred (KServe ModelStatistics)."""
    with grpc.insecure_channel(url) as channel:
        stats = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            service_pb2.ModelStatisticsRequest(), timeout=10)
    return int(stats.model_stats[0].inference_count)


def _env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", str(tmp_path))}


def _record_cmd(teacher: str, cache: Path, tail: list[str], where: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "distill.cli", "record", *(where or ["--teachers", teacher]), "--cache", str(cache),
            "--inputs", "X", "--outputs", "Y", "--key", "index", "--no-progress", *tail]


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=_env(tmp_path),
                          check=False)


def _record_here(cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`_run`'s command, but `distill record`'s entry point run in this process (its loader module
    imported here from `tmp_path`, afresh): (exit status, stdout, stderr). For the runs after a
    test's first, which already ran the real command as a process."""
    from distill.cli import main

    monkeypatch.syspath_prepend(str(tmp_path))  # restored afterwards, with what `distill record` adds
    monkeypatch.delitem(sys.modules, "kd_data", raising=False)
    capsys.readouterr()
    code = main(cmd[3:])
    said = capsys.readouterr()
    monkeypatch.delitem(sys.modules, "kd_data", raising=False)
    return code, said.out, said.err


def _check_store(cache: Path, n: int) -> None:
    """Offline, the store alone yields every batch once, in order, with what the teacher computes."""
    affine = Affine()
    data = _batches(n)
    seen = []
    with DistillReader(data, inputs=["X"], outputs=["Y"], cache=str(cache), cache_mode="read", key="index") as r:
        for batch, out in r:
            seen.append(int(batch["tag"][0]))
            with torch.inference_mode():
                assert torch.allclose(out["Y"], affine(batch["X"]), atol=1e-5), f"batch {seen[-1]}"
    assert_delivered_once_in_order(seen, n)


def test_record_a_module_loader_then_resume_and_extend(teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The first recording is the real command; resuming and extending run its entry point here."""
    (tmp_path / "kd_data.py").write_text(DATA_MODULE)
    cache = tmp_path / "kd"
    before = _inference_count(teacher)
    first = _run(_record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "5"]), tmp_path)
    assert first.returncode == 0, first.stderr
    assert "recorded 50 new samples (0 of 50 already stored)" in first.stdout, first.stdout
    assert _inference_count(teacher) - before == 50
    _check_store(cache, 5)

    before = _inference_count(teacher)
    code, out, err = _record_here(_record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "5"]),
                                  tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "recorded 0 new samples (50 of 50 already stored)" in out, out
    assert _inference_count(teacher) == before, "a resumed recording asked a teacher for stored samples"

    before = _inference_count(teacher)
    code, out, err = _record_here(_record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "8"]),
                                  tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "recorded 30 new samples (50 of 80 already stored)" in out, out
    assert _inference_count(teacher) - before == 30
    _check_store(cache, 8)


# The `distill` console script as pip writes it: run from its own directory, so its sys.path starts
# there, not at the working directory (unlike `python -m distill.cli`).
CONSOLE_SCRIPT = "import sys\nfrom distill.cli import main\nsys.exit(main())\n"


@pytest.mark.parametrize("form", ["--loader", "python -m"])
def test_the_distill_script_imports_the_loader_from_the_working_directory(
        teacher: str, tmp_path: Path, form: str) -> None:
    """`distill record --loader kd_data:loader` (and `-- python -m kd_data`) run in the directory that
    holds kd_data.py, with no PYTHONPATH pointing there, finds it as `python -m` would."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    two = "\n\ndef two():\n    import sys\n    sys.argv = ['kd_data', '--batches', '2']\n    return loader()\n"
    (work / "kd_data.py").write_text(DATA_MODULE + two)
    script = bin_dir / "distill"
    script.write_text(CONSOLE_SCRIPT)
    where = ["--loader", "kd_data:two"] if form == "--loader" else ["--", "python", "-m", "kd_data", "--batches", "2"]
    cmd = [sys.executable, str(script), *_record_cmd(teacher, work / "kd", where)[3:]]
    env = {**_env(tmp_path), "PYTHONPATH": str(REPO)}
    assert str(work) not in env["PYTHONPATH"].split(os.pathsep)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=work, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert "recorded 20 new samples" in done.stdout, done.stdout
    _check_store(work / "kd", 2)


def test_a_recording_killed_mid_write_leaves_a_readable_store_and_a_rerun_completes(
        teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The killed recording is a process; the one before it and the rerun run the entry point here."""
    (tmp_path / "kd_data.py").write_text(DATA_MODULE)
    cache = tmp_path / "kd"
    ready = tmp_path / "ready"
    code, _, err = _record_here(_record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "2"]),
                                tmp_path, monkeypatch, capsys)
    assert code == 0, err
    proc = subprocess.Popen(
        _record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "6", "--hold-after", "4",
                                     "--ready-file", str(ready)]),
        cwd=REPO, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the recording never reached its fifth batch"
        # Batches 2 and 3 go to the teacher; kill once the store's writer has opened a shard for them.
        deadline = time.monotonic() + 60
        while not list(cache.glob("tmp/*.partial")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(cache.glob("tmp/*.partial")), "the recording's writer never started a shard"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    with TeacherOutputStore.open(cache) as store:  # readable: the sealed part, the torn shard ignored
        assert len(store) == 20
        info = store.info()
    assert info.unsealed and all(u.state == "torn" for u in info.unsealed), info.unsealed
    _check_store(cache, 2)

    before = _inference_count(teacher)
    code, out, err = _record_here(_record_cmd(teacher, cache, ["--", "python", "-m", "kd_data", "--batches", "6"]),
                                  tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "recorded 40 new samples (20 of 60 already stored)" in out, out
    assert _inference_count(teacher) - before == 40
    _check_store(cache, 6)


def test_the_module_contract_is_explained(teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any teacher is asked, so `distill record`'s own entry point runs in this process
    (the other tests run it as a process): its exit status and its message on stderr."""
    from distill.cli import main

    (tmp_path / "no_loader.py").write_text("LOADER = []\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # restored afterwards, with what `distill record` adds

    def run(tail: list[str]) -> tuple[int, str]:
        code = main(_record_cmd(teacher, tmp_path / "kd", tail)[3:])
        return code, capsys.readouterr().err

    code, err = run(["--", "python", "-m", "no_loader"])
    assert code == 1
    assert "module 'no_loader'" in err and "defines no loader()" in err, err

    code, err = run(["--", "python", "train.py"])
    assert code == 1 and "python -m MODULE" in err, err

    for tail in ([], ["--loader", "a:b", "--", "python", "-m", "m"]):
        code, err = run(tail)
        assert code == 2 and "name the loader once" in err, err
    assert not (tmp_path / "kd").exists(), "a refused recording made a store"


def test_loader_from_module_sets_argv_only_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "argv_loader.py").write_text("import sys\nSEEN = list(sys.argv)\ndef loader():\n"
                                             "    return [list(sys.argv)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = list(sys.argv)
    got: Any = loader_from_module(["--", "python3", "-m", "argv_loader", "--split", "train"])
    assert got == [["argv_loader", "--split", "train"]]
    assert sys.modules["argv_loader"].SEEN == ["argv_loader", "--split", "train"]
    assert sys.argv == saved
    with pytest.raises(LoaderContractError, match="python -m MODULE"):
        loader_from_module(["python"])


def test_the_python_entry_point_records_and_resumes(teacher: str, tmp_path: Path) -> None:
    cache = tmp_path / "kd"
    before = _inference_count(teacher)
    first = record(_batches(4), cache=cache, teachers=teacher, inputs=["X"], outputs=["Y"], key="index",
                   progress=False)
    assert (first.samples, first.new_samples, first.stored_before, first.stored_after) == (40, 40, 0, 40)
    assert _inference_count(teacher) - before == 40
    before = _inference_count(teacher)
    second = record(_batches(6), cache=cache, teachers=teacher, inputs=["X"], outputs=["Y"], key="index",
                    progress=False)
    assert (second.samples, second.new_samples, second.already_stored) == (60, 20, 40)
    assert _inference_count(teacher) - before == 20
    _check_store(cache, 6)


def test_recording_waits_for_a_writer_that_is_behind(teacher: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer queue of 8 batches, much slower than the teacher: a training reader would drop what
    does not fit (and ask again next time); recording waits instead, so one pass stores every sample."""
    from distill.cache import reader_side, writer

    monkeypatch.setattr(reader_side, "WRITE_QUEUE_BATCHES", 8)
    real_append = writer.ShardWriter.append

    def slow_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)  # a disk much slower than the teacher
        return real_append(self, *args, **kwargs)

    monkeypatch.setattr(writer.ShardWriter, "append", slow_disk)
    result = record(_batches(40), cache=tmp_path / "kd", teachers=teacher, inputs=["X"], outputs=["Y"],
                    key="index", prefetch=1, progress=False)
    assert (result.samples, result.new_samples, result.stored_after) == (400, 400, 400), result
    _check_store(tmp_path / "kd", 40)


def test_record_finds_its_teachers_in_the_registry(tmp_path: Path) -> None:
    """The issue's form: distill record --registry ... --service ... --cache PATH -- python -m MODULE."""
    (tmp_path / "kd_data.py").write_text(DATA_MODULE)
    service = unique_service("record")
    cache = tmp_path / "kd"
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1"]
    with LocalEtcd() as etcd, teacher_process([*args, "--registry", etcd.address, "--service", service],
                                              tmp_path) as (_, info):
        where = ["--registry", etcd.address, "--service", service]
        done = _run(_record_cmd("", cache, ["--", "python", "-m", "kd_data", "--batches", "3"], where), tmp_path)
        assert done.returncode == 0, done.stderr
        assert "recorded 30 new samples" in done.stdout, done.stdout
        assert _inference_count(f"127.0.0.1:{info['port']}") == 30
    _check_store(cache, 3)
