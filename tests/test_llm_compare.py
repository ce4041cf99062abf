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
from pathlib import Path

import pytest

from examples.common import CACHE_ENV
from examples.llm import compare, models

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_smoke_comparison_trains_and_evaluates_every_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(models.TEACHER_ENV, raising=False)
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
