"""`python -m examples.llm.compare --smoke` end to end: no KD, off-policy KD and on-policy
distillation through a real teacher server, on tiny models trained into a temporary cache.

Checked on what the run wrote: every arm trained and was evaluated (finite held-out perplexity and
teacher NLL of its own samples, on the same number of sampled held-out tokens), the on-policy arm
spent the off-policy arm's teacher-token budget (within one sampled sequence) and no KD none, the
on-policy loss (a reverse KL) fell, and with the smoke's warm start every arm of the seed trained
from the warm-start checkpoint's very weights (equal digests of every parameter and buffer), which
its plain LM steps had trained (its loss fell).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.common import CACHE_ENV
from examples.llm import compare, models

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache for the module: the first comparison trains the smoke tokenizer and teacher
    there (``ensure_teacher``), the other one finds them."""
    path = tmp_path_factory.mktemp("compare-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(path))
        mp.delenv(models.TEACHER_ENV, raising=False)
        yield path


def test_the_smoke_comparison_trains_and_evaluates_every_arm(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    assert compare.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == {compare.START, *compare.ARMS} and len(result["runs"]) == 4
    settings = result["settings"]
    start = runs.pop(compare.START)
    assert settings["warm_start_steps"] == compare.SMOKE_WARM_START_STEPS > 0
    assert start["steps"] == settings["warm_start_steps"] and start["teacher_tokens"] == 0
    assert start["last_loss"] < start["first_loss"]
    assert {r["start_digest"] for r in runs.values()} == {start["start_digest"]}
    assert set(result["mean"]) == {compare.START, *compare.ARMS}
    for r in runs.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
        assert math.isfinite(r["teacher_nll"]) and r["teacher_nll"] > 0.0 and r["student_nll"] > 0.0
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    assert len({r["sample_tokens"] for r in runs.values()}) == 1  # every arm judged on as many sampled tokens
    assert runs["no KD"]["sample_tokens"] == settings["eval_prompts"] * settings["new_tokens"]
    budget = runs["off-policy KD"]["teacher_tokens"]
    assert runs["no KD"]["teacher_tokens"] == 0
    assert runs["off-policy KD"]["steps"] == runs["no KD"]["steps"] == settings["steps"]
    assert budget <= runs["on-policy"]["teacher_tokens"] < budget + settings["new_tokens"]
    assert runs["on-policy"]["last_loss"] < runs["on-policy"]["first_loss"]


def test_a_mixed_on_policy_arm_trains_on_text_in_some_steps_from_the_seed_initialisation(
        cache: Path, tmp_path: Path) -> None:
    """``--on-policy-fraction 0.5`` (GKD's lambda) with no warm start: the on-policy arm spends the
    same budget, some of its steps (not all) on training text; every arm starts from the seed's
    random initialisation, the same weights."""
    out = tmp_path / "compare.json"
    assert compare.main(["--smoke", "--warm-start-steps", "0", "--on-policy-fraction", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == set(compare.ARMS) and len(result["runs"]) == 3  # no warm-start row
    assert len({r["start_digest"] for r in runs.values()}) == 1
    on = runs["on-policy"]
    assert 0 < on["text_steps"] < on["steps"]
    assert runs["no KD"]["text_steps"] == runs["off-policy KD"]["text_steps"] == 0
    budget = runs["off-policy KD"]["teacher_tokens"]
    assert budget <= on["teacher_tokens"] < budget + result["settings"]["new_tokens"]
    assert math.isfinite(on["perplexity"]) and math.isfinite(on["teacher_nll"])
    assert math.isfinite(on["first_loss"]) and math.isfinite(on["last_loss"])


def test_a_text_rollout_is_the_text_with_the_students_own_top_k_and_log_probs() -> None:
    """``onpolicy.text_rollout`` on a real (random) Llama: the ids are the text, the mask covers the
    positions that predict a token after the prompt, and there the ids and ``log q`` are the
    model's own top-k and log-probability of the text's next token, as ``sample`` records them."""
    import torch

    from examples.llm import onpolicy

    torch.manual_seed(0)
    model = models.build("student-smoke", 50, max_len=16)
    texts = torch.randint(0, 50, (3, 12))
    r = onpolicy.text_rollout(model, texts, 4, k=5)
    assert torch.equal(r.input_ids, texts) and r.tokens == 3 * 8
    assert r.mask[:, 3:11].all() and not r.mask[:, :3].any() and not r.mask[:, 11].any()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=texts).logits.float(), dim=-1)
    assert torch.equal(r.score_ids[:, 3:11], logprobs[:, 3:11].topk(5, dim=-1).indices.to(torch.int32))
    assert not r.score_ids[:, :3].any() and not r.score_ids[:, 11].any()
    expected = logprobs[:, 3:11].gather(-1, texts[:, 4:, None]).squeeze(-1)
    assert torch.allclose(r.student_logprobs[:, 3:11], expected) and not r.student_logprobs[:, :3].any()
    assert model.training  # restored
