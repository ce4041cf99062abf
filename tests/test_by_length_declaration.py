"""A teacher that batches padded rows by length says so, and students' routers keep their requests
in flight to it instead of reading its queueing as overload.

The declaration travels two ways, both checked against real servers: the registry record
(`TeacherRecord.batches_by_length`, a teacher process registered in a real etcd) and the model
configuration (`parameters["batches_by_length"]`, read by `tritonclient` over gRPC and HTTP and by
the student's own client for static teacher lists). Teachers that do not batch by length (no
padded input, or `--no-length-buckets`) say nothing, and keep the latency gradient.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import DistillReader, RouterConfig
from distill.teacher_client import TeacherClient
from protos.kserve import BY_LENGTH_PARAMETER
from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.etcd_fixtures import arun, unique_service
from tests.servers import ServerThread, teacher_process
from tests.test_padded_batching import PADDED, UNPADDED


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    seq_models.GATE.set()
    yield
    seq_models.GATE.set()


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def _server(model: str, length_buckets: bool = True) -> ServerThread:
    return ServerThread(ServerConfig(
        model=model, name="seq", device="cpu", instances=1, metrics_port=0, http_port=0,
        batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=2000, length_buckets=length_buckets)))


def _by_length(config: dict[str, Any]) -> dict[str, object]:
    """The by-length declaration among a ModelConfig's parameters (it carries others: a fingerprint,
    the capabilities)."""
    return {k: v for k, v in config.get("parameters", {}).items() if k == BY_LENGTH_PARAMETER}


def _declared(s: ServerThread) -> tuple[dict[str, object], dict[str, object], bool, bool]:
    """What the teacher says over gRPC (tritonclient), HTTP, its registry record, and what the
    student's client reads from it."""
    assert s.server is not None
    with tg.InferenceServerClient(s.url) as c:
        config = c.get_model_config("seq", as_json=True)["config"]
        grpc_params = _by_length(config)
        queue = int(config["dynamic_batching"]["default_queue_policy"]["max_queue_size"])
        assert queue == (2048 if grpc_params else 512), f"it says it queues {queue} requests"
    url = f"http://127.0.0.1:{s.server.http_port}/v2/models/seq/config"
    http_params = _by_length(json.loads(urllib.request.urlopen(url, timeout=10).read()))

    async def fetch() -> bool:
        client = TeacherClient(s.url)
        try:
            return (await client.fetch_metadata("seq", "", timeout=10)).batches_by_length
        finally:
            await client.close()

    return grpc_params, http_params, s.server.record().batches_by_length, asyncio.run(fetch())


def test_a_padded_teacher_that_batches_by_length_says_so_everywhere() -> None:
    with _server(PADDED) as s:
        grpc_params, http_params, recorded, fetched = _declared(s)
    want = {BY_LENGTH_PARAMETER: {"string_value": "true"}}
    assert grpc_params == want and http_params == want
    assert recorded and fetched


@pytest.mark.parametrize(("model", "buckets"), [(UNPADDED, True), (PADDED, False)],
                         ids=["no-padded-input", "no-length-buckets"])
def test_other_teachers_say_nothing(model: str, buckets: bool) -> None:
    with _server(model, length_buckets=buckets) as s:
        grpc_params, http_params, recorded, fetched = _declared(s)
    assert grpc_params == {} and http_params == {}
    assert not recorded and not fetched


def test_a_teacher_that_batches_by_length_queues_four_students_rows() -> None:
    """By default it takes 2,048 queued rows before it sheds (four students' 512), where any other
    teacher takes 512 requests: requests of 64 rows queue past 512 while its one instance is held,
    and the first refused one comes once 2,048 wait."""
    with _server(PADDED) as s:
        assert s.server is not None
        batcher = s.server.batcher
        mask = (torch.arange(12) < torch.arange(64)[:, None] % 12 + 1).long()  # rows of 1..12 tokens
        tokens, mask = mask.numpy(), mask.numpy()  # padded: its rows are queued one by one
        outcomes: list[str] = []

        def done(result: object, error: InferenceServerException | None) -> None:
            outcomes.append("ok" if error is None else error.status())

        seq_models.GATE.clear()  # the one instance holds its first batch; the autouse fixture reopens it
        with tg.InferenceServerClient(s.url) as c:
            depths = []
            for _ in range(40):  # 2,560 rows: past the bound
                inputs = [tg.InferInput("TOKENS", [64, 12], "INT64"), tg.InferInput("MASK", [64, 12], "INT64")]
                inputs[0].set_data_from_numpy(tokens)
                inputs[1].set_data_from_numpy(mask)
                before = len(outcomes)
                c.async_infer("seq", inputs, done, outputs=[tg.InferRequestedOutput("POOLED")], client_timeout=60)
                for _ in range(500):  # at most 10 s for it to be queued or refused
                    if batcher.queue_depth > (depths[-1] if depths else 0) or len(outcomes) > before:
                        break
                    time.sleep(0.02)
                depths.append(batcher.queue_depth)
            seq_models.GATE.set()
            for _ in range(1500):  # at most 30 s for every answer
                if len(outcomes) == 40:
                    break
                time.sleep(0.02)
    assert 2048 - 64 <= max(depths) < 2048 + 64, f"the queue held at most {max(depths)} rows"
    assert len(outcomes) == 40, "a request was never answered"
    assert outcomes.count("StatusCode.RESOURCE_EXHAUSTED") >= 1 and set(outcomes) == {
        "ok", "StatusCode.RESOURCE_EXHAUSTED"}, outcomes


_ROW_BYTES = 2 * 12 * 8 + 12 * seq_models.VOCAB * 4  # a row of `_padded_batches` and its answered LOGITS


def _padded_batches(n: int, rows: int = 4, width: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        mask = (torch.arange(width) < lengths[:, None]).long()
        ids = torch.randint(1, seq_models.VOCAB, (rows, width), generator=g) * mask
        out.append({"tokens": ids, "mask": mask})
    return out


def _stat(reader: DistillReader, endpoint: str, key: str = "limit") -> float:
    """One figure of the reader's router for the teacher at `endpoint` (any service): its in-flight
    limit by default."""
    (value,) = [float(t[key]) for teachers in reader.stats().teachers.values()  # type: ignore[arg-type]
                for e, t in teachers.items() if e == endpoint]
    return value


def test_a_student_keeps_by_length_rows_in_flight_to_a_registered_teacher_that_batches_by_length(
        etcd: LocalEtcd, tmp_path: Path) -> None:
    """From the registry record alone: the reader's router holds `by_length_rows` rows in flight to
    the padded teacher (its limit counts rows), and the limit is still there after a pass, whatever
    the answers' latency did."""
    service = unique_service("bylen")
    args = ["--model", PADDED, "--name", "seq", "--device", "cpu", "--max-batch-size", "64",
            "--registry", etcd.address, "--service", service, "--instance-id", "padded-1", "--ttl", "3"]
    config = RouterConfig(initial_limit=2.0, max_limit=6, by_length_rows=40)
    with teacher_process(args, tmp_path) as (_, info):
        async def recorded() -> bool:
            async with open_registry(etcd.address) as reg:
                return (await reg.teachers(service))["padded-1"].record.batches_by_length

        assert arun(recorded())
        batches = _padded_batches(24)
        with DistillReader(batches, registry=etcd.address, service=service, model="seq",
                           inputs={"TOKENS": "tokens", "MASK": "mask"}, outputs=["LOGITS"], prefetch=8,
                           router=config, timeout=30.0) as reader:
            got = [out["LOGITS"] for _, out in reader]
            limit = _stat(reader, info["endpoint"])
            (unit,) = [t["limit_counts"] for ts in reader.stats().teachers.values() for t in ts.values()]
    assert len(got) == len(batches)
    assert all(g.shape == (4, 12, seq_models.VOCAB) for g in got)
    assert limit == 40.0, f"the by-length teacher's limit left by_length_rows: {limit}"
    assert unit == "rows"


def test_a_static_teacher_list_reads_the_declaration_from_the_model_config() -> None:
    """No registry: the student reads ModelConfig, and the router holds `by_length_rows` rows in
    flight to the padded teacher, while the unpadded one follows the gradient from the initial
    limit, in calls."""
    config = RouterConfig(initial_limit=2.0, max_limit=6, by_length_rows=40)
    with _server(PADDED) as padded, DistillReader(_padded_batches(12), teachers=padded.url, model="seq",
                       inputs={"TOKENS": "tokens", "MASK": "mask"}, outputs=["LOGITS"], router=config,
                       timeout=30.0) as reader:
        assert sum(1 for _ in reader) == 12  # the rows answered in time grow the limit: 2 + 48, at most 40
        padded_limit = _stat(reader, padded.url)
    with _server(UNPADDED) as plain:
        tokens = [{"tokens": b["tokens"][:, :5].clamp(min=1)} for b in _padded_batches(4)]
        with DistillReader(tokens, teachers=plain.url, model="seq", inputs={"TOKENS": "tokens"},
                           outputs=["LOGITS"], router=config, timeout=30.0) as reader:
            assert sum(1 for _ in reader) == 4
            plain_limit = _stat(reader, plain.url)
    assert padded_limit == 40.0
    assert plain_limit < 6.0


class _CountingLoader:
    """Padded batches; counts how many the reader has taken from it."""

    def __init__(self, n: int, rows: int = 4) -> None:
        self.batches = _padded_batches(n, rows)
        self.taken = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in self.batches:
            self.taken += 1
            yield b


def _read_ahead(loader: _CountingLoader, want: int) -> int:
    """Batches taken from the loader while the training loop has taken none: once `want` are
    (at most 15 s), and half a second later, so that a read-ahead deeper than `want` shows.

    The readers of these tests deliver unordered: in order, a batch answered before an earlier one
    lends its slot to the loader (``distill.readahead``), so the count would also depend on the
    order the teacher's length buckets answered in."""
    for _ in range(150):
        if loader.taken >= want:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    return loader.taken


@pytest.mark.parametrize(("model", "rows", "prefetch", "want"),
                         [(PADDED, 4, None, 12), (PADDED, 8, None, 6), (PADDED, 4, 3, 4), (UNPADDED, 4, None, 5)],
                         ids=["by-length-default", "by-length-larger-batches", "by-length-explicit", "plain-default"])
def test_the_reader_reads_ahead_enough_for_a_teacher_that_batches_by_length(
        model: str, rows: int, prefetch: int | None, want: int) -> None:
    """`prefetch` unset: 4 batches, or `by_length_rows` rows (40: 10 batches of 4 rows, 5 of 8) for
    each teacher that batches by length (its metadata may arrive after the pass began: the pass
    deepens); set, it is what it says. Answered batches the training loop has not taken lend their
    slots, a quarter of them (at least one): 12, 6, 4 and 5 batches read."""
    loader = _CountingLoader(30, rows)
    if model == UNPADDED:
        loader.batches = [{"tokens": b["tokens"][:, :5].clamp(min=1)} for b in loader.batches]
    inputs = {"TOKENS": "tokens", "MASK": "mask"} if model == PADDED else {"TOKENS": "tokens"}
    with _server(model) as s, DistillReader(loader, teachers=s.url, model="seq", inputs=inputs, outputs=["LOGITS"],
                                            router=RouterConfig(max_limit=8, by_length_rows=40), prefetch=prefetch,
                                            timeout=30.0, ordered=False) as reader:  # no slots lent: see below
        it = iter(reader)
        ahead = _read_ahead(loader, want)
        assert sum(1 for _ in it) == 30
    assert ahead == want


@pytest.mark.parametrize(("read_ahead_mb", "depth"), [(None, 10), (6.5 * 4 * _ROW_BYTES / 2**20, 6)],
                         ids=["default", "six-batches"])
def test_read_ahead_mb_bounds_what_the_batches_read_ahead_hold(read_ahead_mb: float | None, depth: int) -> None:
    """A row here holds 2,592 bytes once answered (ids and mask, 96 bytes each, and 12 x 50 fp32
    logits). The pass reads 4 batches ahead until the first answer shows what a row holds, then 10
    for the teacher's 40 rows, or 6 within a budget of 6.5 batches: once the training loop has
    taken 6 batches, 6 + 6 have been read, not 6 + 10. A training loop that takes batches 10 ms
    apart or more (`SLOW_TAKE_S`) has the answered batches it has not taken lend their slots, a
    quarter of them: one more (two for 10); these 6 are taken at once, which a stalled machine may
    still see as slow."""
    most = 6 + depth + max(1, depth // 4)
    kwargs = {} if read_ahead_mb is None else {"read_ahead_mb": read_ahead_mb}
    loader = _CountingLoader(30)
    with _server(PADDED) as s, DistillReader(loader, teachers=s.url, model="seq", inputs={"TOKENS": "tokens", "MASK":
                                             "mask"}, outputs=["LOGITS"], timeout=30.0,
                                             router=RouterConfig(max_limit=8, by_length_rows=40), ordered=False,
                                             **kwargs) as reader:
        it = iter(reader)
        first = _read_ahead(loader, 4)
        taken = [next(it) for _ in range(6)]
        after = _read_ahead(loader, 6 + depth)
        ahead = reader.stats().read_ahead
        rest = sum(1 for _ in it)
    assert 4 <= first <= 12 and 6 + depth <= after <= most and ahead == depth
    assert len(taken) + rest == 30
    assert taken[0][1]["LOGITS"].nbytes + sum(v.nbytes for v in loader.batches[0].values()) == 4 * _ROW_BYTES


def _teachers(reader: DistillReader) -> int:
    return sum(len(ts) for ts in reader.stats().teachers.values())


def test_a_pass_reads_further_ahead_while_another_such_teacher_is_there(etcd: LocalEtcd, tmp_path: Path) -> None:
    """Two teachers that batch by length, the second registered while the pass waits on the
    training loop: the pass deepens from one teacher's 20 rows (5 batches of 4) to two teachers'
    (10), each plus the quarter (at least one) that answered batches not yet taken lend while the
    training loop has taken none: 6, then 12. When the second leaves, it narrows back: the training
    loop takes 7 batches at once, and the loader reads at most the one that brings the batches out
    to 5 + 1 again (12 or 13 read, not 19)."""
    service = unique_service("deepen")

    def args(iid: str) -> list[str]:
        return ["--model", PADDED, "--name", "seq", "--device", "cpu", "--max-batch-size", "64",
                "--registry", etcd.address, "--service", service, "--instance-id", iid, "--ttl", "3"]

    loader = _CountingLoader(40)
    with teacher_process(args("a"), tmp_path), DistillReader(
            loader, registry=etcd.address, service=service, model="seq", inputs={"TOKENS": "tokens", "MASK": "mask"},
            outputs=["LOGITS"], router=RouterConfig(max_limit=4, by_length_rows=20), timeout=30.0,
            ordered=False) as reader:
        it = iter(reader)
        one = _read_ahead(loader, 6)
        with teacher_process(args("b"), tmp_path):
            two = _read_ahead(loader, 12)
        for _ in range(150):  # b deregistered on its way out: at most 15 s for the reader to see it
            if _teachers(reader) == 1:
                break
            time.sleep(0.1)
        assert _teachers(reader) == 1, "the second teacher never left the reader's pool"
        first = [next(it) for _ in range(7)]
        after = _read_ahead(loader, 13)
        rest = sum(1 for _ in it)
    assert (one, two) == (6, 12) and after in (12, 13)
    assert len(first) + rest == 40


@pytest.mark.parametrize("students", [1, 2])
def test_a_teacher_that_batches_by_length_still_sheds_and_no_reader_loses_anything(students: int) -> None:
    """Each student's rows in flight (grown over its first 8 batches) are more than this teacher's
    queue of 3 rows takes while its one instance is held: it sheds (RESOURCE_EXHAUSTED), the routers
    halve their limits, and every batch still arrives at its own student, answered, in order; two
    students sharing the teacher get the same answers for the same rows (to float summation order)."""
    batches = _padded_batches(32)
    server = ServerThread(ServerConfig(
        model=PADDED, name="seq", device="cpu", instances=1, metrics_port=0,
        # A batch holds one request's 4 rows, whatever arrives before it forms (a loaded machine
        # delays the batcher): the other requests must queue, and past 3 the teacher sheds.
        batching=BatchingConfig(max_batch_size=4, max_queue_delay_us=2000, max_queue_size=3)))
    got: list[list[torch.Tensor]] = [[] for _ in range(students)]
    with server as s, contextlib.ExitStack() as stack:
        readers = [stack.enter_context(DistillReader(
            batches, teachers=s.url, model="seq", inputs={"TOKENS": "tokens", "MASK": "mask"}, outputs=["LOGITS"],
            router=RouterConfig(by_length_rows=48), timeout=30.0)) for _ in range(students)]
        its = [iter(r) for r in readers]
        for i, it in enumerate(its):
            got[i].extend(next(it)[1]["LOGITS"] for _ in range(8))
        before = sum(_stat(r, s.url, "overloaded") for r in readers)
        seq_models.GATE.clear()  # the one instance holds its next batch; the autouse fixture reopens it

        def train(i: int) -> None:
            got[i].extend(out["LOGITS"] for _, out in its[i])

        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(students)]
        for t in threads:
            t.start()
        overloaded = 0.0
        for _ in range(300):  # at most 30 s
            time.sleep(0.1)
            if (overloaded := sum(_stat(r, s.url, "overloaded") for r in readers) - before) > 0:
                break
        seq_models.GATE.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a student never got all its batches"
    assert overloaded > 0, "the teacher never shed: the test checked nothing"
    for answers in got:
        assert len(answers) == len(batches)
        for b, logits, first in zip(batches, answers, got[0], strict=True):
            assert logits.shape == (4, 12, seq_models.VOCAB)
            assert not logits[b["mask"] == 0].any(), "padding must come back as zeros"
            assert logits[b["mask"] == 1].abs().sum() > 0
            # the same rows batched with others of other widths: equal up to float summation order
            torch.testing.assert_close(logits, first, atol=1e-6, rtol=1e-5)
