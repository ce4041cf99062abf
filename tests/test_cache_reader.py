"""DistillReader with a teacher-output store (cache=PATH), and `distill record`, against real teachers."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

pytest.importorskip("pyarrow")

from distill import DistillReader, NoTeacherError, add_distill_args
from distill.cache import NamespaceMismatchError, StoreNotFoundError, TeacherOutputStore
from distill.cache.reader_side import CacheMissError
from distill.reader import ReaderOptions
from protos.kserve import service_pb2, service_pb2_grpc
from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.faults.helpers import assert_delivered_once_in_order
from tests.models import Affine
from tests.servers import REPO, ServerThread

AFFINE = Affine()
ROWS = 10


def _expected(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return AFFINE(x)


def _batches(n: int, rows: int = ROWS) -> list[dict[str, torch.Tensor]]:
    """Batch i holds samples i*rows .. i*rows+rows-1; a sample's input depends on its index only."""
    out = []
    for i in range(n):
        idx = torch.arange(i * rows, (i + 1) * rows)
        x = torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(int(k))) for k in idx])
        out.append({"X": x, "index": idx, "tag": torch.full((rows,), i)})
    return out


def _inference_count(url: str) -> int:
    """Samples the teacher itself says it inferred (KServe ModelStatistics)."""
    with grpc.insecure_channel(url) as channel:
        stats = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            service_pb2.ModelStatisticsRequest(), timeout=10)
    return int(stats.model_stats[0].inference_count)


def _epoch(reader: DistillReader, n: int) -> list[dict[str, torch.Tensor]]:
    """One pass: every batch once, in order, with the model's outputs; returns the teacher outputs."""
    seen, outs = [], []
    for batch, teacher in reader:
        seen.append(int(batch["tag"][0]))
        assert teacher is not None
        assert torch.allclose(teacher["Y"], _expected(batch["X"]), atol=1e-5), f"batch {seen[-1]} has wrong outputs"
        outs.append(teacher)
    assert_delivered_once_in_order(seen, n)
    return outs


@pytest.fixture(scope="module")
def teacher() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                       batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=200))
    with ServerThread(cfg) as srv:
        yield srv


def _reader(data: list[dict[str, torch.Tensor]], teacher: ServerThread | None, cache: Path, mode: str,
            **kw: object) -> DistillReader:
    where: dict[str, object] = {"teachers": teacher.url} if teacher is not None else {}
    return DistillReader(data, inputs=["X"], outputs=["Y"], cache=str(cache), cache_mode=mode, key="index",
                         no_teacher_timeout=5.0, **where, **kw)


def test_read_write_stores_then_a_full_hit_sends_nothing(teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(6)
    cache = tmp_path / "kd"
    before = _inference_count(teacher.url)
    with _reader(data, teacher, cache, "read_write") as reader:
        first = _epoch(reader, len(data))
    assert _inference_count(teacher.url) - before == 6 * ROWS
    with TeacherOutputStore.open(cache) as store:
        assert len(store) == 6 * ROWS
        assert store.namespace.model_name == "affine" and store.namespace.outputs == ("Y",)

    before = _inference_count(teacher.url)
    with _reader(data, teacher, cache, "read_write") as reader:
        again = _epoch(reader, len(data))
        _epoch(reader, len(data))  # a second pass over the same loader: still from the store
    assert _inference_count(teacher.url) == before, "a batch whose samples are all stored went to a teacher"
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a["Y"], b["Y"]), "the store's outputs differ from the teacher's"


def test_a_second_pass_of_the_same_reader_reads_what_the_first_stored(
        teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(4)
    before = _inference_count(teacher.url)
    with _reader(data, teacher, tmp_path / "kd", "read_write") as reader:
        _epoch(reader, len(data))
        assert reader._engine is not None and reader._engine.cache is not None
        assert reader._engine.cache.wait_sealed(30), "the pass's shard was not sealed"
        _epoch(reader, len(data))
    assert _inference_count(teacher.url) - before == len(data) * ROWS, "the second pass asked the teacher again"


def test_content_hash_keys_make_a_bytes_keyed_store(teacher: ServerThread, tmp_path: Path) -> None:
    import hashlib

    data = [(b["X"], [hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in b["X"]], int(b["tag"][0]))
            for b in _batches(3)]
    cache = tmp_path / "kd"
    for mode in ("read_write", "read_write"):
        before = _inference_count(teacher.url)
        with DistillReader(data, teachers=teacher.url, inputs={"X": 0}, outputs=["Y"], cache=str(cache),
                           cache_mode=mode, key=1) as reader:
            seen = []
            for (x, _, tag), out in reader:
                seen.append(tag)
                assert torch.allclose(out["Y"], _expected(x), atol=1e-5)
        assert_delivered_once_in_order(seen, 3)
        asked = _inference_count(teacher.url) - before
    assert asked == 0, "the second run asked the teacher for stored samples"
    with TeacherOutputStore.open(cache) as store:
        assert store.key_type == "bytes" and len(store) == 3 * ROWS


def test_partial_hit_sends_only_the_missing_samples(teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(5)
    cache = tmp_path / "kd"
    # Store the even samples only, from the teacher, through a reader over a loader of those.
    evens = [{k: v[::2] for k, v in b.items()} for b in data]
    with _reader(evens, teacher, cache, "write") as reader:
        _epoch(reader, len(evens))
    before = _inference_count(teacher.url)
    with _reader(data, teacher, cache, "read_write") as reader:
        _epoch(reader, len(data))  # stored and teacher rows merged back in batch order
    assert _inference_count(teacher.url) - before == len(data) * ROWS // 2, "stored samples went to a teacher"
    with TeacherOutputStore.open(cache) as store:
        assert len(store) == len(data) * ROWS, "the teacher's rows were not written back"


def test_stats_count_hits_misses_and_written_samples(teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(4)
    cache = tmp_path / "kd"
    evens = [{k: v[::2] for k, v in b.items()} for b in data]
    with _reader(evens, teacher, cache, "write") as reader:
        _epoch(reader, len(evens))
        assert reader._engine is not None and reader._engine.cache is not None
        assert reader._engine.cache.wait_sealed(30), "the pass's shard was not sealed"
        stats = reader.stats()
    assert (stats.cache_hits, stats.cache_misses, stats.cache_written) == (0, 4 * ROWS // 2, 4 * ROWS // 2)

    with _reader(data, teacher, cache, "read_write") as reader:
        _epoch(reader, len(data))
        assert reader._engine is not None and reader._engine.cache is not None
        assert reader._engine.cache.wait_sealed(30), "the pass's shard was not sealed"
        stats = reader.stats()
        assert (stats.cache_hits, stats.cache_misses, stats.cache_written) == (4 * ROWS // 2,) * 3
        _epoch(reader, len(data))  # the second pass: every sample is stored now
        stats = reader.stats()
    assert (stats.cache_hits, stats.cache_misses, stats.cache_written) == (4 * ROWS * 3 // 2, 4 * ROWS // 2,
                                                                           4 * ROWS // 2)


@pytest.mark.parametrize("ordered", [True, False])
def test_stored_batches_overtaking_teacher_batches_keep_exactly_once_delivery(
        teacher: ServerThread, tmp_path: Path, ordered: bool) -> None:
    """Odd batches are stored (ready at once), even ones go to the teacher: ordered delivery still
    yields loader order, and either way every batch comes exactly once with the right outputs."""
    data = _batches(12)
    cache = tmp_path / "kd"
    with _reader(data[1::2], teacher, cache, "write") as reader:
        for _ in reader:
            pass
    before = _inference_count(teacher.url)
    with _reader(data, teacher, cache, "read_write", ordered=ordered, prefetch=6) as reader:
        seen = []
        for batch, out in reader:
            seen.append(int(batch["tag"][0]))
            assert torch.allclose(out["Y"], _expected(batch["X"]), atol=1e-5)
    assert_delivered_once_in_order(seen if ordered else sorted(seen), len(data))
    assert _inference_count(teacher.url) - before == 6 * ROWS


def test_read_mode_without_teachers_trains_offline_and_a_miss_names_its_key(
        teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(4)
    cache = tmp_path / "kd"
    with _reader(data[:3], teacher, cache, "write") as reader:
        _epoch(reader, 3)
    with _reader(data[:3], None, cache, "read") as reader:
        _epoch(reader, 3)
        assert reader.options.services == ()

    with _reader(data, None, cache, "read") as reader:
        it = iter(reader)
        for _ in range(3):
            next(it)
        with pytest.raises(CacheMissError, match=r"sample key 30 ") as err:
            next(it)
        assert err.value.key == 30

    with _reader(data, None, cache, "read", fallback="hard_labels") as reader:
        got = [(int(b["tag"][0]), t) for b, t in reader]
    assert [tag for tag, _ in got] == [0, 1, 2, 3]
    assert got[3][1] is None and all(t is not None for _, t in got[:3])


def test_read_mode_with_a_teacher_asks_it_for_misses_and_stores_nothing(
        teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(3)
    cache = tmp_path / "kd"
    with _reader(data[:1], teacher, cache, "write") as reader:
        _epoch(reader, 1)
    before = _inference_count(teacher.url)
    with _reader(data, teacher, cache, "read") as reader:
        _epoch(reader, 3)
    assert _inference_count(teacher.url) - before == 2 * ROWS
    with TeacherOutputStore.open(cache) as store:
        assert len(store) == ROWS


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_read_mode_replays_a_full_store_without_waiting_for_the_teachers_named(
        teacher: ServerThread, tmp_path: Path) -> None:
    """cache_mode="read" never waits for a teacher: a fully stored replay with a teacher list left on
    the command line (nothing listens there) trains at once. A reader that waited for the teachers
    first would raise NoTeacherError after no_teacher_timeout (or outlive the test's own timeout)."""
    data = _batches(3)
    cache = tmp_path / "kd"
    with _reader(data, teacher, cache, "write") as reader:
        _epoch(reader, 3)
    before = _inference_count(teacher.url)
    args = add_distill_args(argparse.ArgumentParser()).parse_args(
        ["--distill_teachers", f"127.0.0.1:{_closed_port()}", "--distill_no_teacher_timeout", "600",
         "--distill_cache", str(cache), "--distill_cache_mode", "read"])
    with DistillReader.from_args(args, data, inputs=["X"], outputs=["Y"], key="index") as reader:
        _epoch(reader, 3)
        _epoch(reader, 3)
        stats = reader.stats()
    assert (stats.cache_hits, stats.cache_misses) == (6 * ROWS, 0)
    assert _inference_count(teacher.url) == before, "a stored sample was asked of a teacher"


def test_read_mode_asks_only_a_teacher_whose_answers_the_store_would_name(
        teacher: ServerThread, tmp_path: Path) -> None:
    """Reading only, the store is opened by its own namespace, without waiting for a teacher; a
    teacher then answers this reader's misses only if its answers carry that namespace, so stored
    and fresh rows of one batch never come from different models."""
    data = _batches(2)
    cache = tmp_path / "kd"
    with _reader(data[:1], teacher, cache, "write") as reader:
        _epoch(reader, 1)
    other = ServerConfig(model="tests.models:affine", name="other_affine", device="cpu",
                         batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=200))
    with ServerThread(other) as srv, DistillReader(data, teachers=srv.url, inputs=["X"], outputs=["Y"],
                                                   cache=str(cache), cache_mode="read", key="index",
                                                   no_teacher_timeout=2.0) as reader:
        it = iter(reader)
        batch, out = next(it)
        assert int(batch["tag"][0]) == 0 and torch.allclose(out["Y"], _expected(batch["X"]), atol=1e-5)
        with pytest.raises(NoTeacherError, match="would not match the teacher-output store") as err:
            next(it)
        assert "model_name: store has 'affine', this teacher gives 'other_affine'" in str(err.value)
        assert _inference_count(srv.url) == 0


def test_read_mode_with_teachers_and_no_store_fails_at_start(tmp_path: Path) -> None:
    """Nothing listens at the teacher's address: a reader that waited for a teacher before looking
    for the store would fail with NoTeacherError after no_teacher_timeout instead."""
    reader = DistillReader(_batches(1), teachers="127.0.0.1:1", inputs=["X"], cache=str(tmp_path / "none"),
                           cache_mode="read", key="index", no_teacher_timeout=120.0)
    with pytest.raises(StoreNotFoundError, match=r"no teacher-output store at .*record it first") as err:
        reader.start()
    assert "read_write" in str(err.value)
    reader.close()
    assert not (tmp_path / "none").exists(), "a read-only reader made a store"


def test_a_store_of_other_settings_is_refused(teacher: ServerThread, tmp_path: Path) -> None:
    data = _batches(2)
    cache = tmp_path / "kd"
    with _reader(data, teacher, cache, "write") as reader:
        _epoch(reader, 2)
    with pytest.raises(NamespaceMismatchError, match="dtype") as err:
        _reader(data, teacher, cache, "read_write", output_dtype="fp16").start()
    assert "dtype" in err.value.fields
    with pytest.raises(NamespaceMismatchError, match="model_name") as err:
        _reader(data, None, cache, "read", model="another-teacher").start()
    assert err.value.fields == ("model_name",)


def test_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    data = _batches(1)
    with pytest.raises(ValueError, match="key="):
        DistillReader(data, inputs=["X"], cache=str(tmp_path), cache_mode="read")
    with pytest.raises(ValueError, match="cache_mode"):
        DistillReader(data, inputs=["X"], teachers="127.0.0.1:1", cache=str(tmp_path), cache_mode="rw", key="index")
    with pytest.raises(ValueError, match="exactly one of"):  # offline needs cache_mode='read'
        DistillReader(data, inputs=["X"], cache=str(tmp_path), key="index")


def test_a_batch_without_the_key_field_fails_the_pass_with_what_to_fix(
        teacher: ServerThread, tmp_path: Path) -> None:
    data = [{"X": b["X"], "tag": b["tag"]} for b in _batches(2)]
    reader = DistillReader(data, teachers=teacher.url, inputs=["X"], cache=str(tmp_path / "kd"), key="index")
    with reader, pytest.raises(TypeError, match="cache key 'index'"):
        next(iter(reader))


def test_flags_reach_the_reader(tmp_path: Path) -> None:
    import argparse

    parser = add_distill_args(argparse.ArgumentParser())
    args = parser.parse_args(["--distill_cache", str(tmp_path), "--distill_cache_mode", "read"])
    reader = DistillReader.from_args(args, [], inputs=["X"], key="index")
    assert reader.options.cache == str(tmp_path) and reader.options.cache_mode == "read"
    assert reader.options.services == ()


def _record(teacher: ServerThread, cache: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "record_data.py").write_text(
        "import torch\n"
        "def loader():\n"
        "    out = []\n"
        "    for i in range(5):\n"
        "        idx = torch.arange(i * 10, (i + 1) * 10)\n"
        "        x = torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(int(k))) for k in idx])\n"
        "        out.append({'X': x, 'index': idx})\n"
        "    return out\n")
    env_path = f"{tmp_path}:{REPO}"
    return subprocess.run(
        [sys.executable, "-m", "distill.cli", "record", "--teachers", teacher.url, "--cache", str(cache),
         "--loader", "record_data:loader", "--inputs", "X", "--outputs", "Y", "--key", "index", "--no-progress"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=False)


def test_record_fills_the_store_and_resumes(teacher: ServerThread, tmp_path: Path) -> None:
    cache = tmp_path / "kd"
    before = _inference_count(teacher.url)
    first = _record(teacher, cache, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "recorded 50 new samples" in first.stdout, first.stdout
    assert _inference_count(teacher.url) - before == 50

    before = _inference_count(teacher.url)
    second = _record(teacher, cache, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "recorded 0 new samples (50 of 50 already stored)" in second.stdout, second.stdout
    assert _inference_count(teacher.url) == before, "a resumed record asked a teacher for stored samples"

    data = _batches(5)
    with _reader(data, None, cache, "read") as reader:  # what record stored is what the teacher computes
        _epoch(reader, 5)


# ---- per-position outputs of a sequence teacher, padded per batch -----------------------------------------------


@pytest.fixture(scope="module")
def seq_teacher() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.seq_models:causal_conv_lm", name="seq", device="cpu", instances=1,
                       batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=2000))
    with ServerThread(cfg) as srv:
        yield srv


SEQ_LENGTHS = [3, 11, 5, 8, 2, 12, 7, 4, 9, 6, 10, 5]


def _seq_batches(order: list[int], rows: int) -> list[dict[str, torch.Tensor]]:
    """Samples `order` in batches of `rows`, each right-padded to its batch's longest sample."""
    out = []
    for start in range(0, len(order), rows):
        idx = order[start:start + rows]
        width = max(SEQ_LENGTHS[i] for i in idx)
        tokens = torch.zeros((len(idx), width), dtype=torch.int64)
        mask = torch.zeros((len(idx), width), dtype=torch.int64)
        for r, i in enumerate(idx):
            g = torch.Generator().manual_seed(100 + i)
            tokens[r, :SEQ_LENGTHS[i]] = torch.randint(1, seq_models.VOCAB, (SEQ_LENGTHS[i],), generator=g)
            mask[r, :SEQ_LENGTHS[i]] = 1
        out.append({"TOKENS": tokens, "MASK": mask, "index": torch.tensor(idx)})
    return out


def _seq_pass(data: list[dict[str, torch.Tensor]], url: str, **kw: object) -> list[dict[str, torch.Tensor]]:
    with DistillReader(data, teachers=url, inputs=["TOKENS", "MASK"], outputs=["LOGITS"], top_k=5,
                       no_teacher_timeout=5.0, **kw) as reader:
        got = [(batch, out) for batch, out in reader]
    assert [b["index"].tolist() for b, _ in got] == [b["index"].tolist() for b in data]
    return [out for _, out in got]


def _same_on_real_positions(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                            batch: dict[str, torch.Tensor]) -> None:
    real = batch["MASK"].bool()
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].shape == w.shape, f"{name}: {list(got[name].shape)} != {list(w.shape)}"
        assert got[name].dtype == w.dtype
        assert torch.allclose(got[name][real].double(), w[real].double(), atol=1e-5), name


@pytest.mark.parametrize("tail", [False, True], ids=["top-k", "logprobs-top-k-tail"])
def test_per_position_outputs_of_other_lengths_merge_into_the_batchs_padded_shape(
        seq_teacher: ServerThread, tmp_path: Path, tail: bool) -> None:
    """Samples stored from batches of one padded width come back in batches of another: a partial
    hit merges stored rows of several lengths with the teacher's padded answer, and a full hit
    yields the batch's own width; on every real position both equal a reader without a store
    (also with log-probabilities and the per-position tail mass)."""
    cache = tmp_path / "kd"
    n = len(SEQ_LENGTHS)
    kw: dict[str, object] = {"logprobs": True, "topk_tail": True} if tail else {}
    recorded = _seq_batches(list(range(0, n, 2)), rows=3)  # the even samples, widths of their batches
    _seq_pass(recorded, seq_teacher.url, cache=str(cache), cache_mode="write", key="index", **kw)
    with TeacherOutputStore.open(cache) as store:
        assert len(store) == n // 2
        assert store.output_specs["LOGITS_TOPK_VALUES"].variable, "per-position outputs were stored padded"
        if tail:
            assert store.output_specs["LOGITS_TOPK_TAIL"].variable, "the per-position tail was stored padded"
        assert store.output_specs["LOGITS_TOPK_INDICES"].dtype == "int16", "ids of a 50-token vocabulary"

    shuffled = [5, 0, 7, 2, 9, 4, 11, 6, 1, 8, 3, 10]  # batches mixing stored and new samples, other widths
    data = _seq_batches(shuffled, rows=4)
    plain = _seq_pass(data, seq_teacher.url, **kw)
    merged = _seq_pass(data, seq_teacher.url, cache=str(cache), cache_mode="read_write", key="index", **kw)
    for got, want, batch in zip(merged, plain, data, strict=True):
        _same_on_real_positions(got, want, batch)
    with TeacherOutputStore.open(cache) as store:
        assert len(store) == n, "the teacher's rows were not written back"

    regrouped = _seq_batches(list(range(n)), rows=6)  # every sample stored: full hits, new widths
    plain = _seq_pass(regrouped, seq_teacher.url, **kw)
    stored = _seq_pass(regrouped, seq_teacher.url, cache=str(cache), cache_mode="read", key="index", **kw)
    for got, want, batch in zip(stored, plain, regrouped, strict=True):
        _same_on_real_positions(got, want, batch)


def test_a_teachers_own_transform_defaults_never_reach_a_store_unnamed(tmp_path: Path) -> None:
    """A teacher started with --logprobs --temperature 2 as its defaults: a reader with a store
    states every value transform, so it gets the raw outputs its namespace ("logits", no
    temperature) names, not the teacher's log-probabilities stored under that name."""
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu", logprobs=True, temperature=2.0,
                       batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=200))
    data = _batches(3)
    with ServerThread(cfg) as srv, _reader(data, srv, tmp_path / "kd", "read_write") as reader:
        _epoch(reader, len(data))  # raw outputs: equal to the model's own
    with TeacherOutputStore.open(tmp_path / "kd") as store:
        assert store.namespace.values == "logits" and store.namespace.temperature is None
    plain = ReaderOptions(teachers="127.0.0.1:1", inputs=["X"], outputs=["Y"], logprobs=True)
    assert plain.logprobs is True and plain.temperature is None, "only a reader with a store fills them in"
