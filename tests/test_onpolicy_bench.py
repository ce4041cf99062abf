"""W7 (benchmarks/onpolicy.py): an on-policy step with the teacher served vs in process.

The in-process scoring the benchmark compares against must be the teacher's log-softmax at the
sampled tokens; the benchmark runs end to end in its smallest mode (the smoke teacher, trained
into a private cache, and a real teacher-server process) and its JSON must hold sane figures:
scored tokens counted by the server, the mesh's token log-probs equal to the in-process teacher's,
and the wire's bytes per scored token what the tensors' sizes say.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import onpolicy
from benchmarks.device import DeviceChoice
from benchmarks.onpolicy_parts import Loop, models, score_inprocess
from examples.common import CACHE_ENV
from tests.bench_runs import run_benchmark_main


def test_inprocess_scoring_is_the_log_softmax_at_the_next_tokens() -> None:
    with models(shape="tiny", teacher="", tiny=False, prompts=4, prompt_len=6, seed=3, threads=1,
                choice=DeviceChoice()) as m:
        loop = Loop(m, steps=2, batch=2, new_tokens=5, lr=1e-3, seed=3, choice=DeviceChoice())
        batch = loop.generate(1)
        ids = batch["input_ids"]
        assert ids.shape == (2, 11) and torch.equal(ids[:, :6], m.prompts[2:4])  # step 1's prompts, continued
        got = score_inprocess(m.teacher, ids)
        with torch.no_grad():
            lp = torch.log_softmax(m.teacher(input_ids=ids).logits.float(), dim=-1)
        want = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(got[:, :-1], want, atol=1e-5, rtol=1e-5)
        assert (got[:, -1] == 0).all()
        before = [p.detach().clone() for p in m.student.parameters()]
        loss = loop.train(loop.reset(), batch, got.clone())
        assert torch.isfinite(torch.tensor(loss))
        assert any(not torch.equal(a, b) for a, b in zip(before, m.student.parameters(), strict=True))


@pytest.mark.timeout(330)  # it trains the smoke teacher and starts a server
def test_the_benchmark_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    w6 = tmp_path / "w6.json"  # the W6 result the teacher's scoring rate is compared with
    w6.write_text(json.dumps({"medians_tokens_per_s": {"server_buckets": 1000.0, "inprocess": 1100.0},
                              "machine": {"device": "cpu", "compute_dtype": "FP32"}}))
    doc = run_benchmark_main(onpolicy.main, ["--quick", "--tiny", "--threads", "1", "--out", "w7", "--w6-results",
                                             str(w6)], tmp_path / "results", name="w7",
                             env={CACHE_ENV: str(tmp_path / "cache"), "DISTILL_LLM_TEACHER": None})
    s = doc["settings"]
    assert (s["reps"], s["steps"], s["batch"], s["prompt_len"], s["new_tokens"]) == (2, 3, 4, 8, 16)
    assert set(doc["steps_per_s"]) == {"mesh", "inprocess"} and all(v > 0 for v in doc["steps_per_s"].values())
    assert doc["ratio_mesh_over_inprocess"]["pairs"] == 2 and doc["ratio_mesh_over_inprocess"]["headline"] > 0
    assert doc["scored_tokens"]["per_step"] == 4 * 16 and doc["scored_tokens"]["per_loop"] == 3 * 4 * 16
    for t in doc["per_rep"]["mesh"]:
        assert t["scored_tokens"] == 3 * 4 * 16
        assert t["teacher_counted_tokens"] == t["teacher_positions"] == 3 * 4 * (8 + 16)  # by the server's metrics
        assert t["teacher_compute_s"] > 0
    check = doc["check"]  # one batch's token log-probs, mesh vs in process
    assert check["allclose"] and check["max_abs_diff"] <= 1e-4 and check["shape"] == [4, 24]
    assert check["mean_token_logprob"] < 0
    wire = doc["wire_bytes_per_scored_token"]
    # fp32 log-probs at every one of the 24 positions for 16 scored tokens; int64 ids and mask in.
    assert wire["response_tensors"] == 4 * 24 / 16 and wire["request_tensors"] == 16 * 24 / 16
    assert wire["response_tensors"] < wire["response_protobuf"] < wire["response_tensors"] + 4
    assert wire["request_and_response_protobuf"] > wire["request_tensors"] + wire["response_tensors"]
    scoring = doc["teacher_scoring"]
    assert scoring["mesh_positions_per_compute_s"] > 0 and scoring["inprocess_positions_per_s"] > 0
    assert scoring["w6"]["server_tokens_per_s"] == 1000.0 and scoring["w6"]["same_setup"]
    assert scoring["mesh_over_w6_server"] == pytest.approx(scoring["mesh_positions_per_compute_s"] / 1000.0, abs=2e-4)
    assert doc["machine"]["device"] == "cpu" and doc["teacher"]["vocab_size"] == 512
    assert doc["server_exit_code"] == 0
