"""The experts example (examples/experts): its --quick run end to end, and its parts.

``python -m examples.experts --quick --jobs 1`` runs once for the module in this process (no
worker processes): three teachers trained for a few steps into a temporary cache, served by real
``teacher-server`` processes on loopback, and the four student arms reading through
``DistillReader``. The assertions are on the JSON it wrote. The per-sample routing (``route_by``)
is checked against the experts read one at a time, through real gRPC servers of the trained
experts (in this process, loading the factory ``teacher-server`` loads).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.common import CACHE_ENV
from examples.experts import __main__ as experts_main
from examples.experts import arms, mesh, tasks
from examples.experts.models import TinyLM
from teacher_server import BatchingConfig, ServerConfig
from tests.servers import ServerThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    """The --quick run's JSON and the cache it trained its teachers into."""
    cache = tmp_path_factory.mktemp("experts-cache")
    out = cache / "results.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        assert experts_main.main(["--quick", "--jobs", "1", "--out", str(out)]) == 0
        yield json.loads(out.read_text()), cache


def test_quick_run_measures_every_arm_and_the_experts_know_their_task(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    assert set(result["summary"]) == set(arms.ARMS)
    assert len(result["runs"]) == len(arms.ARMS)  # one seed
    for run in result["runs"]:
        assert set(run["accuracy"]) == set(tasks.TASKS)
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values()), run
        assert math.isfinite(run["final_loss"]), run
    teachers = result["teachers"]
    assert set(teachers) == {"add", "rev", "generalist"}
    # Chance for an exact answer of 3 to 6 words out of 8 is at most 8**-3; the rev expert is far above it
    # and above the add expert, which never saw the task.
    assert teachers["rev"]["accuracy"]["rev"] > 0.05
    assert teachers["rev"]["accuracy"]["rev"] > teachers["add"]["accuracy"]["rev"]
    assert result["parameters"]["student"] < result["parameters"]["teacher"]


def test_routed_rows_get_their_own_experts_outputs(quick: tuple[dict[str, Any], Path]) -> None:
    _, cache = quick
    files = {task: cache / "experts" / "quick" / f"{task}.pt" for task in tasks.TASKS}
    batches = tasks.mixed_batches(2, 8, seed=3)
    options = mesh.offpolicy_options(arms.K)
    with contextlib.ExitStack() as stack:
        endpoints = {task: stack.enter_context(ServerThread(ServerConfig(
            model="examples.experts.models:load", model_args={"path": str(file)}, name=mesh.MODEL_NAME,
            device="cpu", instances=1, batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=0)))).url
            for task, file in files.items()}
        routed = list(mesh.routed_pairs(batches, endpoints, options))
        alone = {task: list(mesh.single_pairs(batches, endpoints[task], options)) for task in tasks.TASKS}
    assert len(routed) == len(batches)
    for step, (batch, outputs) in enumerate(routed):
        assert torch.equal(batch["input_ids"], batches[step]["input_ids"])
        for i, task in enumerate(tasks.TASKS):
            rows = batch["task"] == i
            # The server batches a row with other rows, routed or alone: equal up to float rounding.
            assert torch.equal(outputs["LOGITS_TOPK_INDICES"][rows],
                               alone[task][step][1]["LOGITS_TOPK_INDICES"][rows]), (step, task)
            for name in ("LOGITS_TOPK_VALUES", "LOGITS_TOPK_TAIL"):
                assert torch.allclose(outputs[name][rows], alone[task][step][1][name][rows], atol=1e-5), \
                    (step, task, name)
    # The two experts differ, so a row read from the wrong one would show.
    a, b = (alone[t][0][1]["LOGITS_TOPK_VALUES"] for t in tasks.TASKS)
    assert not torch.equal(a, b)


def test_problems_held_out_are_never_trained_on_and_batches_label_the_answers() -> None:
    rng = random.Random(0)
    train = {p.prompt for t in tasks.TASKS for p in tasks.draw(t, 300, rng, held_out=False)}
    held = {p.prompt for t in tasks.TASKS for p in tasks.draw(t, 300, rng, held_out=True)}
    assert not train & held
    p = tasks.Problem("add", ("4", "7", "+", "8", "5", "="), ("1", "3", "2"))
    b = tasks.batch([p])
    ids, labels = b["input_ids"][0].tolist(), b["labels"][0]
    assert tasks.decode(ids[6:]) == ("1", "3", "2")
    counted = (labels != -100).nonzero().squeeze(1).tolist()
    assert counted == [5, 6, 7, 8]  # '=' predicts the first digit ... the last digit predicts <eos>
    assert labels[8] == tasks.EOS and [ids[i + 1] for i in counted[:-1]] == labels[counted[:-1]].tolist()


def test_rollout_masks_the_sampled_answer_and_keeps_the_prompt() -> None:
    torch.manual_seed(0)
    student = TinyLM("student")
    batch = tasks.mixed_batches(1, 8, seed=5)[0]
    r = arms.rollout(student, batch, k=4, generator=torch.Generator().manual_seed(0))
    for row in range(8):
        start = int(batch["prompt_len"][row])
        assert torch.equal(r.input_ids[row, :start], batch["input_ids"][row, :start])
        on = r.mask[row].nonzero().squeeze(1).tolist()
        assert on and on[0] == start - 1 and on == list(range(on[0], on[-1] + 1))  # one run from the prompt's end
        assert bool((r.score_ids[row][r.mask[row] == 0] == 0).all())
        assert bool((r.student_logprobs[row][r.mask[row] == 1] < 0).all())
