"""The W2/W3 load generator (`benchmarks.serving_measure.measure_server`) against a real batching
teacher-server, in both of its transports: unary calls and one ModelStreamInfer stream a client.
Both keep their clients' requests flowing, the server's statistics show batching merged them, and
a refused request is counted, then fails the measurement with the server's own words. With
`--streams` the benchmark's report carries each server variant's stream twin and its ratios; a
peer (PyTriton) that dies under its load leaves the run instead of ending it. The floor under
both (`benchmarks.grpc_floor`, a bare gRPC server) runs at its smallest."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.grpc import service_pb2_grpc

from benchmarks import grpc_floor, instance_path, serving
from benchmarks.cpu import CpuUsage
from benchmarks.serving_measure import Measurement, make_request, measure_server, open_channel
from teacher_server import ServerConfig
from teacher_server.config import BatchingConfig
from tests.bench_runs import positive, run_benchmark_main
from tests.servers import REPO, ServerThread

REF = "examples.refteacher:build"


@pytest.fixture(scope="module")
def ref_server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model=REF, name="ref_teacher", device="cpu", instances=1,
                       batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=2000))
    with ServerThread(cfg) as s:
        yield s


async def _measure(url: str, transport: str, model: str = "ref_teacher") -> Measurement:
    channel = open_channel(url)
    try:
        request, _ = make_request(8)
        request.model_name = model
        return await asyncio.wait_for(measure_server(
            [service_pb2_grpc.GRPCInferenceServiceStub(channel)], request, batch=8, concurrency=16, warmup_s=0.2,
            duration_s=1.0, server_pids=[], transport=transport), timeout=60)
    finally:
        await channel.close()


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_both_transports_keep_the_clients_requests_flowing_and_batched(ref_server: ServerThread,
                                                                     transport: str) -> None:
    m = asyncio.run(_measure(ref_server.url, transport))
    assert m.errors == 0
    assert m.requests > 0 and m.samples_per_s > 0
    assert m.server_batches and m.server_batches > 0
    # 16 clients x 8 rows in flight: the server merged requests into batches of more than one.
    assert m.mean_server_batch is not None and m.mean_server_batch > 8


def test_a_stream_whose_requests_are_refused_fails_the_measurement_with_the_servers_words(
        ref_server: ServerThread) -> None:
    with pytest.raises(RuntimeError, match=r"too many failed requests; last: NOT_FOUND: .*no_such_model"):
        asyncio.run(_measure(ref_server.url, "stream", model="no_such_model"))


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="unary or stream"):
        asyncio.run(measure_server([], make_request(8)[0], batch=8, concurrency=1, warmup_s=0.1, duration_s=0.1,
                                   server_pids=[], transport="carrier-pigeon"))


def _rep(rate: float, server: bool) -> Measurement:
    cpu = CpuUsage(wall_s=2.0, client_cores=0.1 if server else 1.9, server_cores=1.8 if server else 0.0,
                   foreign_cores=0.0)
    return Measurement(rate, 10, 2.0, cpu)


def test_with_streams_each_server_variant_has_a_stream_twin_with_the_same_goals() -> None:
    rates = {"w2_inprocess_256": 1000.0, "w2_server_256": 900.0, "w2_server_256_stream": 940.0,
             "w2_pytriton_256": 800.0, "w2_pytriton_256_stream": 700.0, "w3_inprocess_8": 300.0,
             "w3_on": 500.0, "w3_on_stream": 800.0, "w3_off": 100.0, "w3_pytriton": 450.0,
             "w3_pytriton_stream": 1000.0}
    per_rep = {k: [_rep(v, "inprocess" not in k) for _ in range(5)] for k, v in rates.items()}
    doc = serving.summarise(serving.Settings(reps=5, streams=True), per_rep, {})
    doc["machine"] |= {"servers_ran_on": {}}
    r = doc["ratios"]
    assert r["w2_server_over_inprocess_stream"]["headline"] == pytest.approx(0.94)
    assert r["w2_server_over_inprocess_stream"]["goal"] == r["w2_server_over_inprocess"]["goal"] == 0.95
    assert r["w3_on_over_inprocess_256_stream"]["headline"] == pytest.approx(0.8)
    assert r["w3_on_over_inprocess_256_stream"]["verdict"] == "below goal"
    assert r["w2_server_over_pytriton_stream"]["headline"] == pytest.approx(940 / 700)
    assert r["w2_server_over_pytriton_stream"]["verdict"] == "PASS"
    # each twin against PyTriton over the same transport
    assert r["w3_on_over_pytriton_stream"]["headline"] == pytest.approx(0.8)
    assert r["w3_on_over_pytriton_stream"]["verdict"] == "below goal"
    assert "w3_on_over_off_stream" not in r  # batching off runs over unary calls only
    text = serving.report(doc)
    for line in ("W3 server batching ON, 64 x batch 8 (streams)", "W3 streams: batching on / in-process batch 256",
                 "W2 streams: server / PyTriton", "one ModelStreamInfer stream a client"):
        assert line in text


def test_compare_pairs_each_batching_variant_with_its_twin_on_the_compared_server() -> None:
    rates = {"w2_inprocess_256": 1000.0, "w2_server_256": 900.0, "w2_server_256_cmp": 880.0,
             "w3_inprocess_8": 300.0, "w3_on": 540.0, "w3_on_cmp": 500.0, "w3_on_stream": 800.0,
             "w3_on_stream_cmp": 640.0, "w3_off": 100.0}
    per_rep = {k: [_rep(v, "inprocess" not in k) for _ in range(5)] for k, v in rates.items()}
    doc = serving.summarise(serving.Settings(reps=5, streams=True, compare=("--no-malloc-tuning",)), per_rep, {})
    doc["machine"] |= {"servers_ran_on": {}}
    r = doc["ratios"]
    assert r["w3_on_over_compare"]["headline"] == pytest.approx(1.08)
    assert r["w3_on_over_compare_stream"]["headline"] == pytest.approx(1.25)
    assert r["w2_server_over_compare"]["headline"] == pytest.approx(900 / 880)
    assert "w2_server_over_compare_stream" not in r  # its variants were not measured
    assert {r[k]["goal"] for k in r if "compare" in k} == {None}
    assert {r[k]["verdict"] for k in r if "compare" in k} == {"comparison"}
    assert r["w3_on_over_inprocess_256"]["verdict"] == "below goal"  # the goals are unchanged
    text = serving.report(doc)
    for line in ("W3 server batching ON, 64 x batch 8 (streams) [--no-malloc-tuning]",
                 "W3 streams: batching on / batching on [--no-malloc-tuning]"):
        assert line in text
    assert serving.parse_args(["--compare=--no-malloc-tuning", "--compare=--threads=1"]).compare == (
        "--no-malloc-tuning", "--threads=1")
    assert serving.parse_args([]).compare == ()
    assert not serving.parse_args([]).comparing
    assert serving.parse_args(["--compare-tree", str(REPO)]).compare_tree == str(REPO.resolve())
    with pytest.raises(SystemExit):  # not a checkout: refused before anything starts
        serving.parse_args(["--compare-tree", str(REPO / "docs")])


def test_the_streams_flag_is_off_unless_asked_for() -> None:
    assert not serving.parse_args([]).streams
    assert serving.parse_args(["--streams"]).streams


def test_a_peer_that_died_under_its_load_leaves_the_run_and_one_alive_fails_it(tmp_path: Path) -> None:
    calls: list[int] = []

    async def refused() -> Measurement:
        calls.append(1)
        raise ConnectionError("the peer's port refused the connection")

    died: list[str] = []
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ConnectionError):  # still running: the failure is the run's
            asyncio.run(serving.survive_peer(refused, alive, tmp_path / "log", died, "stream clients",
                                             exit_wait_s=0.5)())
        assert not died
        alive.send_signal(signal.SIGSEGV)
        alive.wait(timeout=30)
        measure = serving.survive_peer(refused, alive, tmp_path / "log", died, "stream clients")
        assert asyncio.run(measure()) is None
        assert died == [f"PyTriton exited (signal {int(signal.SIGSEGV)}) while stream clients loaded it; "
                        f"its log: {tmp_path / 'log'}"]
        assert asyncio.run(measure()) is None and len(calls) == 2  # not measured again
    finally:
        alive.kill()
        alive.wait(timeout=30)


@pytest.mark.slow
def test_the_benchmark_measures_w3_over_streams_beside_unary_calls(tmp_path: Path) -> None:
    # The smallest run of the real benchmark with --streams (PyTriton left out: its side runs in
    # tests/test_serving_pytriton_bench.py): the stream twins of the batching server are measured
    # in the same repetition as their unary selves, with the same goals, and reported.
    doc = run_benchmark_main(serving.main, ["--quick", "--streams", "--no-pytriton", "--reps", "1",
                                            "--warmup", "0.3", "--duration", "1", "--instances", "1", "--threads",
                                            "1", "--max-foreign-cores", "0", "--compare=--no-malloc-tuning",
                                            "--compare-tree", str(REPO), "--out", "serving_streams_test"],
                             tmp_path, name="serving_streams_test")
    assert doc["settings"]["streams"] is True
    # With --compare, each batching variant's twin on the compared server, in the same repetition.
    assert set(doc["medians_samples_per_s"]) == {"w2_inprocess_256", "w2_server_256", "w2_server_256_stream",
                                                 "w3_inprocess_8", "w3_on", "w3_off", "w3_on_stream",
                                                 "w2_server_256_cmp", "w2_server_256_stream_cmp", "w3_on_cmp",
                                                 "w3_on_stream_cmp"}
    assert doc["ratios"]["w3_on_over_compare_stream"]["headline"] > 0
    assert doc["settings"]["compare_tree"] == str(REPO.resolve())
    assert f"[--no-malloc-tuning tree {REPO.resolve()}]" in doc["stdout"]
    positive(doc["medians_samples_per_s"])
    (stream,) = doc["per_rep"]["w3_on_stream"]
    assert stream["errors"] == 0 and stream["mean_server_batch"] > 8  # 64 streams' requests were batched
    for name, goal in (("w2_server_over_inprocess_stream", serving.W2_GOAL),
                       ("w3_on_over_inprocess_256_stream", serving.W3_GOAL_VS_INPROC_256)):
        assert doc["ratios"][name]["goal"] == goal and doc["ratios"][name]["headline"] > 0, name
    assert {"w2_server_256_stream", "w3_on_stream"} <= set(doc["server_ms_per_request_medians"])
    assert "W3 server batching ON, 64 x batch 8 (streams)" in doc["stdout"]
    assert set(doc["server_exit_codes"].values()) == {0}


def test_the_instance_path_times_a_batch_as_the_server_runs_it_and_as_model_x(tmp_path: Path) -> None:
    # benchmarks.instance_path at its smallest: both models timed both ways, the instance's added
    # time a request derived from them, and the table prints it.
    doc = run_benchmark_main(instance_path.main, ["--quick", "--requests", "4"], tmp_path, name="instance_path")
    variants = {f"{m}_{v}" for m in ("ref", "ref_hidden8") for v in ("inprocess", "instance")}
    assert set(doc["ms_a_batch_medians"]) == variants
    positive(doc["ms_a_batch_medians"])
    small = doc["models"]["ref_hidden8"]
    added = (small["instance_ms"] - small["inprocess_ms"]) * 1e3 / 4
    assert small["added_us_a_request"] == pytest.approx(added, abs=0.01)
    assert small["inprocess_over_instance"] > 0
    assert "RefTeacher, hidden 8" in doc["stdout"] and "added us a request" in doc["stdout"]


def test_the_instance_path_refuses_cores_it_may_not_use(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        instance_path.parse_args(["--cpus", "4096"])
    assert "may run on cores" in capsys.readouterr().err


def test_the_grpc_floor_measures_a_bare_servers_cpu_a_message_both_ways(tmp_path: Path) -> None:
    # benchmarks.grpc_floor at its smallest: the bare server answered every variant (W2's and W3's
    # message sizes, unary and stream), its CPU a message is positive, and the table prints it.
    doc = run_benchmark_main(grpc_floor.main, ["--quick"], tmp_path, name="grpc_floor")
    names = {f"{w}_{t}" for w in ("w2", "w3") for t in ("unary", "stream")}
    assert set(doc["server_ms_per_message_medians"]) == names
    positive(doc["server_ms_per_message_medians"])
    positive(doc["messages_per_s_medians"])
    assert doc["workloads"]["w2"] == {"rows": 256, "clients": 4, "request_bytes": 256 * 3072 * 4,
                                      "answer_bytes": 256 * 400}
    assert "W3: 8 rows (98,304 B), 64 clients" in doc["stdout"]


def test_each_pytriton_variant_belongs_to_the_pytriton_of_its_transport() -> None:
    assert serving._peer_of("w2_pytriton_256") == serving._peer_of("w3_pytriton") == "pytriton"
    assert serving._peer_of("w2_pytriton_256_stream") == serving._peer_of("w3_pytriton_stream") == "pytriton_stream"
    assert serving._peer_of("w3_on_stream") is None and serving._peer_of("w2_inprocess_256") is None
