"""A padded model's batch cost: the fit of device time against computed positions
(`teacher_server.batch_cost`), the padding floor it lowers (`BatchRules.padding_floor`), and a real
teacher-server process that measures both on an emulated device (`benchmarks.batching_sim:build`:
forward passes of a known fixed and per-position cost on one timeline) and shows them on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from benchmarks.batching_sim import serve_once
from benchmarks.llm_parts import MODEL_NAME, scrape_metrics
from teacher_server.batch_cost import BatchCost, fit
from teacher_server.batch_rules import BatchingConfig, BatchRules
from teacher_server.launch import TeacherProcess
from teacher_server.work import Work

pytestmark = pytest.mark.timeout(120)


def test_the_fit_recovers_a_fixed_and_a_per_position_cost() -> None:
    positions = np.array([500, 1_000, 2_000, 4_000, 8_000, 16_000], dtype=np.float64)
    got = fit(positions, 0.045 + positions / 85_000)
    assert got is not None
    assert got.fixed_s == pytest.approx(0.045) and got.per_position_s == pytest.approx(1 / 85_000)
    assert got.fixed_positions == pytest.approx(0.045 * 85_000)


def test_a_warm_up_batch_and_host_pauses_do_not_tilt_the_fit() -> None:
    rng = random.Random(0)
    cost = BatchCost()
    for i in range(40):
        p = rng.randint(500, 16_000)
        seconds = 0.045 + p / 85_000
        if i == 0:
            seconds *= 20  # the first batch: cuBLAS set-up, first allocations
        elif i % 9 == 0:
            seconds += 0.2  # a pause of the host
        cost.observe(p, seconds * rng.uniform(0.98, 1.02))
    got = cost.current
    assert got is not None and got.batches == 40
    assert got.fixed_s == pytest.approx(0.045, rel=0.15)
    assert 1 / got.per_position_s == pytest.approx(85_000, rel=0.05)


def test_nothing_is_fitted_until_enough_batches_of_different_sizes_ran() -> None:
    cost = BatchCost(min_batches=12)
    for _ in range(11):
        cost.observe(4_000, 0.1)
    assert cost.current is None and cost.fixed_positions == 0.0
    for _ in range(20):  # equal sizes tell the two parts nothing apart
        cost.observe(4_000, 0.1)
    assert cost.current is None and cost.fixed_positions == 0.0
    cost.observe(0, 0.1)  # an empty batch or a clock step is not a sample
    cost.observe(4_000, 0.0)
    assert cost.current is None


def test_a_fit_is_kept_while_the_batches_are_all_alike() -> None:
    """A loaded teacher's batches are all full: they cannot refit the line, and the last fit stands."""
    cost = BatchCost(window=16, min_batches=8)
    for p in [1_000, 2_000, 4_000, 8_000, 16_000, 3_000, 6_000, 12_000]:
        cost.observe(p, 0.02 + p / 100_000)
    assert cost.current is not None and cost.current.fixed_s == pytest.approx(0.02)
    for _ in range(32):  # the window now holds only full batches
        cost.observe(16_000, 0.02 + 16_000 / 100_000)
    kept = cost.current
    assert kept is not None and kept.fixed_s == pytest.approx(0.02) and kept.per_position_s == pytest.approx(1e-5)
    cost.observe(16_000, 1.0)  # one more alike batch, however slow, refits nothing
    cost.observe(16_000, 1.0)
    cost.observe(16_000, 1.0)
    cost.observe(16_000, 1.0)
    assert cost.current is kept


def test_a_negative_intercept_is_no_fixed_cost_and_a_falling_line_no_fit() -> None:
    positions = np.array([1_000, 2_000, 4_000, 8_000], dtype=np.float64)
    got = fit(positions, positions / 50_000 - 0.005)
    assert got is not None and got.fixed_s == 0.0 and got.fixed_positions == 0.0
    assert fit(positions, 1.0 - positions / 50_000) is None
    with pytest.raises(ValueError, match="window"):
        BatchCost(window=4, min_batches=8)


def test_the_floor_falls_by_the_fixed_costs_share_of_a_full_batch() -> None:
    rules = BatchRules(BatchingConfig(max_batch_tokens=16_384, min_padding_efficiency=0.85))
    assert rules.padding_floor() == 0.85 and rules.padding_floor(-5.0) == 0.85
    assert rules.padding_floor(16_384) == pytest.approx(0.425)
    assert rules.padding_floor(0.045 * 85_000) == pytest.approx(0.85 * 16_384 / (16_384 + 3_825))


@dataclass
class _Queued:
    work: Work


def _q(*lengths: int) -> list[_Queued]:
    return [_Queued(Work([], 1, [], (), n)) for n in lengths]


def test_a_small_batch_admits_a_request_that_raises_its_useful_share_of_device_time() -> None:
    admits = BatchRules.admits
    assert admits(10, 10, 22, 24, floor=0.85)  # 22 / 24 keeps the floor
    assert not admits(10, 10, 50, 80, floor=0.85)  # 50 / 80 does not, and no fixed cost is known
    # 10 positions cost the device 10 + 200 positions' worth; with a 40 joining, 50 of 280
    assert admits(10, 10, 50, 80, floor=0.85, fixed=200)
    assert not admits(300, 300, 900, 1_200, floor=0.85, fixed=200)  # a batch past its fixed cost: the floor
    assert not admits(100, 150, 110, 400, floor=0.85, fixed=200)  # 110 / 600 is less than 100 / 350


def test_the_batch_rules_take_the_fixed_cost_into_account() -> None:
    rules = BatchRules(BatchingConfig(max_batch_tokens=10_000))
    assert rules.oldest_first(_q(10), _q(40), floor=0.85) == ([], False)
    grown, _ = rules.oldest_first(_q(10), _q(40), floor=0.85, fixed=200)
    assert [p.work.length for p in grown] == [40]
    # In length order 12 keeps the floor; 30 and 60 join while the batch is smaller than the fixed
    # cost (10 + 12 + 30 = 3 x 30 = 90, then 4 x 60 = 240 >= 200 positions), and 100 would pad it
    # to 0.42: the run stops there.
    candidates = _q(100, 12, 60, 30)
    assert [p.work.length for p in rules.closest_lengths(_q(10), candidates, floor=0.85)] == [12]
    run = rules.closest_lengths(_q(10), candidates, floor=0.85, fixed=200)
    assert [p.work.length for p in run] == [12, 60, 30]  # queue order


FIXED_MS, RATE, BUDGET = 20.0, 100_000.0, 4096


@contextlib.contextmanager
def emulated_teacher(*extra: str) -> Iterator[TeacherProcess]:
    args = ["--model", "benchmarks.batching_sim:build", "--name", MODEL_NAME, "--device", "cpu",
            "--model-arg", f"fixed_ms={FIXED_MS}", "--model-arg", f"tokens_per_s={RATE}",
            "--max-batch-tokens", str(BUDGET), "--max-queue-delay-us", "2000", "--threads", "1",
            # two instances on the one emulated device: each batch's device time must leave out the
            # other instance's batches, or the fit reads 50-70 ms instead of 20
            "--instances", "2",
            "--metrics-port", "0", "--log-level", "WARNING", *extra]
    with TeacherProcess(args, label="batch_cost", stop_grace=10.0) as proc:
        yield proc


def test_the_server_measures_its_batches_cost_and_lowers_the_floor() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(8, 1_000) for _ in range(120)]
    with emulated_teacher("--log-level", "INFO") as proc:
        port = int(proc.ready["metrics_port"])
        before = scrape_metrics(port, ("teacher_batch_fixed_seconds", "teacher_padding_floor"))
        assert before == {"teacher_batch_fixed_seconds": 0.0, "teacher_padding_floor": 0.85}
        cost = asyncio.run(serve_once(proc.endpoint, port, lengths, 24, proc.pid))["batch_cost"]
        logged = [line for line in proc.log_path.read_text().splitlines() if "a batch costs the device" in line]
    assert len(logged) == 1 and "padding floor 0." in logged[0], logged  # once, when first known
    assert cost["fixed_ms"] == pytest.approx(FIXED_MS, rel=0.25)
    assert cost["positions_per_s"] == pytest.approx(RATE, rel=0.25)
    fixed_positions = cost["fixed_ms"] / 1e3 * cost["positions_per_s"]
    assert cost["padding_floor"] == pytest.approx(0.85 * BUDGET / (BUDGET + fixed_positions), rel=0.01)
    assert cost["padding_floor"] < 0.7


def test_without_the_cost_aware_floor_the_floor_stays_as_set() -> None:
    rng = random.Random(2)
    lengths = [rng.randint(8, 1_000) for _ in range(80)]
    with emulated_teacher("--no-cost-aware-floor", "--min-padding-efficiency", "0.8") as proc:
        port = int(proc.ready["metrics_port"])
        cost = asyncio.run(serve_once(proc.endpoint, port, lengths, 24, proc.pid))["batch_cost"]
    assert cost["fixed_ms"] == pytest.approx(FIXED_MS, rel=0.25)  # still measured, for the operator
    assert cost["padding_floor"] == 0.8


def test_a_model_without_padded_inputs_shows_no_batch_cost() -> None:
    from teacher_server.metrics import ServerMetrics

    text = ServerMetrics("m", "1").render()
    assert "teacher_useful_tokens_total" in text and "teacher_batch_fixed_seconds" not in text


def _cpu_teacher_floor(cost_aware_floor: bool | None) -> dict[str, float]:
    """A padded CPU teacher (`tests.seq_models`) after 40 requests of lengths 4..200, 4 clients at a time: lengths
    far enough apart that the cost a position stands out of the fixed cost on a busy machine."""
    import concurrent.futures

    import tritonclient.grpc as tg

    from teacher_server import ServerConfig
    from tests import seq_models
    from tests.servers import ServerThread

    seq_models.GATE.set()
    config = ServerConfig(model="tests.seq_models:causal_conv_lm", name="seq", device="cpu", instances=1,
                          metrics_port=0, batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=2000,
                                                                  cost_aware_floor=cost_aware_floor))
    rng = np.random.default_rng(0)
    with ServerThread(config) as s:
        def send(length: int) -> None:
            c = tg.InferenceServerClient(s.url)
            tokens = rng.integers(1, seq_models.VOCAB, size=(1, length), dtype=np.int64)
            x = tg.InferInput("TOKENS", [1, length], "INT64")
            x.set_data_from_numpy(tokens)
            c.infer("seq", [x], outputs=[tg.InferRequestedOutput("LOGITS")], client_timeout=60)
            c.close()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(send, [int(n) for n in rng.integers(4, 201, size=40)], timeout=60))
        assert s.server is not None and s.server.metrics_port is not None
        return scrape_metrics(s.server.metrics_port, ("teacher_batch_fixed_seconds",
                                                      "teacher_batch_position_seconds", "teacher_padding_floor"))


def test_a_cpu_teacher_keeps_the_floor_as_set_unless_told() -> None:
    """On CPU the instances share the cores with the server's per-request work, so by default the
    fit is shown but the floor stays; asked for, the floor follows the fit there too."""
    default = _cpu_teacher_floor(None)
    assert default["teacher_padding_floor"] == 0.85
    told = _cpu_teacher_floor(True)
    budget = BatchingConfig(max_batch_size=8).token_budget
    fixed, per_position = told["teacher_batch_fixed_seconds"], told["teacher_batch_position_seconds"]
    assert per_position > 0, "40 batches of lengths 4..200 are enough to fit"
    assert told["teacher_padding_floor"] == pytest.approx(0.85 * budget / (budget + fixed / per_position))


def test_the_flags_set_the_floor_and_its_cost_awareness() -> None:
    from teacher_server.cli import build_parser, config_from_args
    from teacher_server.spec import SpecError

    default = config_from_args(build_parser().parse_args(["--model", "x"])).batching
    assert default.cost_aware_floor is None and default.min_padding_efficiency == 0.85  # None: on a GPU
    given = config_from_args(build_parser().parse_args(
        ["--model", "x", "--no-cost-aware-floor", "--min-padding-efficiency", "0.7"])).batching
    assert given.cost_aware_floor is False and given.min_padding_efficiency == 0.7
    with pytest.raises(SpecError, match=r"--min-padding-efficiency: min_padding_efficiency must be in 0\.\.1"):
        config_from_args(build_parser().parse_args(["--model", "x", "--min-padding-efficiency", "1.5"]))
