"""The elastic example under a real ``torchrun``, against a real CV teacher server.

An uninterrupted two-rank run distils (each rank its own student) and writes its results; then two
ranks, the last one dies after epoch 0, torchrun restarts the group, which resumes from the
checkpoint: every rank must exit 0 and the job must print the uninterrupted run's accuracy. Then a
two-rank run is killed and a one-rank run resumes from its checkpoint. No run leaves a worker
behind. The same scenario with more repetitions is ``python -m benchmarks.elastic_restart --runs 8``
(its result is in examples/elastic/README.md); here it runs once to keep the suite short.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks import elastic_restart
from examples.common import CACHE_ENV
from examples.cv import data
from examples.cv import serve as cv_serve
from examples.cv import train_teacher as cv_teacher
from teacher_server import BatchingConfig, ServerConfig
from tests.servers import ServerThread


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """A smoke-trained CV teacher in a private cache, served on loopback: (address, env for torchrun)."""
    cache = tmp_path_factory.mktemp("distill-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        mp.delenv("DISTILL_CV_TEACHER", raising=False)
        assert cv_teacher.main(["--smoke"]) == 0
        config = ServerConfig(model="examples.cv.teacher:build", name=cv_serve.MODEL_NAME, device="cpu",
                              batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=500))
        with ServerThread(config) as srv:
            yield srv.url, {CACHE_ENV: str(cache)}


@pytest.mark.slow
@pytest.mark.timeout(300)  # four torchrun jobs, one after another, on a loaded 2-core machine
def test_restarted_group_exits_zero_with_the_uninterrupted_accuracy(
        teacher: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = teacher
    results = elastic_restart.scenario(url, tmp_path, runs=1, env=env)
    assert [r.kind for r in results] == ["uninterrupted", "crash+restart",
                                         "killed (2 ranks)", "resumed (1 rank)"]
    bad = elastic_restart.problems(results)
    assert not bad, "\n\n".join(bad)  # in full: a run's output ends with where it failed
    uninterrupted = results[0]
    assert uninterrupted.world == 2 and uninterrupted.accuracy is not None and 0.0 <= uninterrupted.accuracy <= 1.0
    assert re.search(r"rank 0: distilling as student \S+-rank0", uninterrupted.output), uninterrupted.output
    assert json.loads((tmp_path / "uninterrupted.json").read_text())["world_size"] == 2
    restarted = [r for r in results if r.kind == "crash+restart"]
    assert all(r.crashed and r.resumed and r.returncode == 0 for r in restarted)
    assert {r.accuracy for r in restarted} == {results[0].accuracy}
    one_rank = results[-1]
    assert one_rank.world == 1 and "after epoch 0, 1 rank(s)" in one_rank.output
    assert not (tmp_path / "resize.pt").exists(), "a finished run removes its checkpoint"
    # Every run's workers carry a path in tmp_path: other torchrun jobs (another test, in parallel) do not match.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False)
    assert leftovers.stdout == "", f"torchrun left workers behind: {leftovers.stdout}"


def test_every_world_size_draws_the_same_permutation_per_epoch() -> None:
    """What a resume with another world size relies on: epoch e is one permutation of the training
    set (generator seed * 1000 + e), which the ranks split in contiguous slices."""
    x = torch.arange(40, dtype=torch.float32).reshape(40, 1, 1, 1)
    y = torch.arange(40)

    def labels(world: int, rank: int, epoch: int) -> list[int]:
        loader = data.Batches(x, y, batch_size=20 // world, seed=3, augment=False, rank=rank, world=world)
        loader.epoch = epoch
        return [int(v) for b in loader for v in b["label"]]

    for epoch in (1, 2):
        assert labels(2, 0, epoch) + labels(2, 1, epoch) == labels(1, 0, epoch)
    assert labels(1, 0, 1) != labels(1, 0, 2)
