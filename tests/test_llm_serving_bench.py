"""W6 (benchmarks/llm_serving.py) and the batcher choices it measures.

The batcher tests queue requests behind a held model instance (the `_Queued` helper of the padded
batching tests) and check which batches run: with more requests of a length bucket queued than
one batch holds, the batch takes the closest lengths; with length buckets off, any lengths share
a batch. The benchmark runs end to end in its smallest mode (the smoke teacher, trained into a
private cache) and its JSON must hold sane figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.common import CACHE_ENV
from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.bench_runs import run_benchmark_main
from tests.servers import ServerThread
from tests.test_padded_batching import PADDED, _check, _ok, _open_gate, _Queued, reference

__all__ = ["_open_gate", "reference"]  # fixtures used by name


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One private cache for both benchmark runs: the first trains the smoke teacher into it, the other
    serves that teacher (the training is the example's business, not what these tests check)."""
    return tmp_path_factory.mktemp("llm-serving-cache")


def _private(cache: Path) -> dict[str, str | None]:
    """The benchmark's environment: the private cache, and no teacher named from outside."""
    return {CACHE_ENV: str(cache), "DISTILL_LLM_TEACHER": None}


def _server(max_batch_size: int, length_buckets: bool = True) -> ServerThread:
    return ServerThread(ServerConfig(
        model=PADDED, name="seq", device="cpu", instances=1, metrics_port=0,
        batching=BatchingConfig(max_batch_size=max_batch_size, max_queue_delay_us=20000,
                                length_buckets=length_buckets),
    ))


def test_a_full_bucket_batches_the_closest_lengths(reference: seq_models.CausalConvLM) -> None:
    with _server(max_batch_size=3) as s:
        q = _Queued(s, first=20)
        for length in (33, 60, 35, 62, 34, 61):
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
    for tokens, r in zip(q.sent, results, strict=True):
        _check(reference, tokens, _ok(r))
    # Oldest first would run 33, 60, 35 padded to 60; the oldest (33) takes its neighbours 35, 34.
    assert batches == [(1, 20), (3, 35), (3, 62)]


def test_without_length_buckets_any_lengths_share_a_batch(reference: seq_models.CausalConvLM) -> None:
    with _server(max_batch_size=64, length_buckets=False) as s:
        q = _Queued(s, first=20)
        for length in (5, 30, 9):
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
    for tokens, r in zip(q.sent, results, strict=True):
        _check(reference, tokens, _ok(r))
    assert batches == [(1, 20), (3, 30)]


@pytest.mark.timeout(330)  # trains the smoke teacher when it runs first, and starts two servers
def test_the_benchmark_runs_and_reports_sane_figures(tmp_path: Path, private_cache: Path) -> None:
    from benchmarks import llm_serving

    args = ["--quick", "--tiny", "--reps", "1", "--sequences", "24", "--batch", "4", "--max-foreign-cores", "0",
            "--out", "w6"]
    doc = run_benchmark_main(llm_serving.main, args, tmp_path, name="w6", env=_private(private_cache))
    assert doc["sequences"]["count"] == 24
    assert doc["sequences"]["min_len"] >= 8
    assert set(doc["medians_tokens_per_s"]) == {"inprocess", "server_buckets", "server_no_buckets"}
    assert all(v > 0 for v in doc["medians_tokens_per_s"].values())
    pad = doc["padding_efficiency"]
    for k in ("inprocess", "server_buckets", "server_no_buckets"):
        assert 0 < pad[k] <= 1
    wire = doc["wire_bytes_per_token"]
    # top-20 fp16 values (40 B) + int32 ids (80 B) + an fp16 tail (2 B) per token; fp32 logits: 4 B x vocab.
    assert wire["top20_fp16_tail"] == 122.0
    assert wire["full_vocab_fp32"] == 4 * doc["teacher"]["vocab_size"]
    assert doc["ratios"]["server_buckets_over_inprocess"]["headline"] > 0
    assert doc["server_exit_codes"] == {"server_buckets": 0, "server_no_buckets": 0}
    # each server pass names the server's busiest threads: its event loop and its model instances
    names = {t["name"] for t in doc["per_rep"]["server_buckets"][0]["threads"]}
    assert {"main", "instance-0"} <= names


@pytest.mark.timeout(330)  # trains the smoke teacher when it runs first, and starts a server
def test_the_reader_mode_runs_and_reports_sane_figures(tmp_path: Path, private_cache: Path) -> None:
    from benchmarks import llm_serving

    args = ["--mode", "reader", "--quick", "--tiny", "--reps", "1", "--sequences", "24", "--batch", "4",
            "--student-batch", "3", "--max-foreign-cores", "0"]
    doc = run_benchmark_main(llm_serving.main, args, tmp_path, name="llm_reader", env=_private(private_cache))
    assert "padded rows match one request per row" in doc["stdout"]
    # the student's batches (--student-batch) apart from the server's batch bound (--batch)
    assert doc["sequences"]["count"] == 24 and doc["sequences"]["student_batch"] == 3
    assert doc["settings"]["batch"] == 4
    assert set(doc["medians_tokens_per_s"]) == {"reader", "reader_defaults", "one_per_request", "inprocess"}
    assert all(v > 0 for v in doc["medians_tokens_per_s"].values())
    pad = doc["padding_efficiency"]
    for k in ("reader", "reader_defaults", "one_per_request", "inprocess"):
        assert 0 < pad[k] <= 1
    assert doc["check"]["max_abs_diff_rows_vs_one_per_request"] <= 2e-2
    assert doc["ratios"]["reader_over_one_per_request"]["headline"] > 0
    assert doc["server_exit_code"] == 0
    assert len(doc["machine"]["load_average_at_start"]) == 3


def test_the_summary_without_the_buckets_off_server() -> None:
    """`--skip-buckets-off` (a GPU run's time is short) leaves that variant and its ratios out."""
    from benchmarks import llm_serving
    from benchmarks.llm_parts import Measurement

    s = llm_serving.parse_args(["--skip-buckets-off", "--reps", "2", "--max-foreign-cores", "0"])
    assert not s.buckets_off
    with pytest.raises(SystemExit):  # argparse names the rule: --student-batch >= 0
        llm_serving.parse_args(["--student-batch", "-1"])
    per_rep = {
        "inprocess": [Measurement(1000.0, 900, 0.9, computed_tokens=1000), Measurement(1100.0, 900, 0.8,
                                                                                          computed_tokens=1000)],
        "server_buckets": [Measurement(950.0, 900, 0.95, computed_tokens=950, wire_bytes=900 * 122),
                           Measurement(990.0, 900, 0.9, computed_tokens=950, wire_bytes=900 * 122)],
    }
    doc = llm_serving.summarise(s, per_rep, {"server_buckets": 0}, full_bytes=4.0 * 50)
    assert set(doc["ratios"]) == {"server_buckets_over_inprocess"}
    assert doc["ratios"]["server_buckets_over_inprocess"]["per_rep"] == [0.95, 0.9]
    assert set(doc["padding_efficiency"]) == {"inprocess", "server_buckets", "goal", "verdict"}
    assert doc["wire_bytes_per_token"]["top20_fp16_tail"] == 122.0
    machine = {"cpu_model": "x", "cpu_count": 1, "server_instances": 1, "server_torch_threads": 1,
               "inprocess_loops": 1}
    assert "length buckets off" not in llm_serving.report(doc | {"machine": machine})
    # --alt-server-arg: a third server, compared with the default one and with in-process
    s = llm_serving.parse_args(["--skip-buckets-off", "--alt-server-arg=--no-async-outputs"])
    assert s.alt_server_args == ("--no-async-outputs",)
    per_rep["server_alt"] = [Measurement(760.0, 900, 1.2, computed_tokens=950, wire_bytes=900 * 122),
                             Measurement(900.0, 900, 1.0, computed_tokens=950, wire_bytes=900 * 122)]
    doc = llm_serving.summarise(s, per_rep, {"server_buckets": 0, "server_alt": 0}, full_bytes=4.0 * 50)
    assert doc["ratios"]["server_over_server_alt"]["per_rep"] == [1.25, 1.1]
    assert doc["ratios"]["server_alt_over_inprocess"]["per_rep"] == [0.76, 0.8182]
    assert "server with --no-async-outputs" in llm_serving.report(doc | {"machine": machine})


def test_the_reader_keeps_reader_rows_in_flight_in_student_batches() -> None:
    from benchmarks.llm_reader import reader_options
    from benchmarks.llm_serving import parse_args

    s = parse_args(["--mode", "reader", "--student-batch", "16", "--reader-rows", "64"])
    assert s.reader_ahead == 4
    options = reader_options("127.0.0.1:1", s)
    assert options["prefetch"] == 4
    router = options["router"]
    assert router.initial_limit == router.min_limit == 4.0 and router.max_limit == 16
    assert parse_args(["--mode", "reader", "--student-batch", "16", "--clients", "256"]).reader_ahead == 16
    assert "router" not in reader_options("127.0.0.1:1", s, matched=False)
    with pytest.raises(SystemExit):
        parse_args(["--mode", "reader", "--reader-rows", "-1"])
