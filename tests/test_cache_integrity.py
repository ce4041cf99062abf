"""Checksums of the teacher-output store: damaged bytes are an error naming shard and keys, never an answer.

Stores are recorded through a real teacher server (as in test_cache_reader), then bytes of the
shard file are flipped in place, as a bad disk, a partial copy or bit rot would.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from distill import DistillReader
from distill.cache import DamagedRecordError, Namespace, TeacherOutputStore
from distill.cache import cli as cache_cli
from distill.cache.reader_side import CacheMissError
from teacher_server import BatchingConfig, ServerConfig
from tests.servers import REPO, ServerThread
from tests.test_cache_reader import _batches, _inference_count

BATCHES = 20
ROWS = 10
FLIP = 64
NS = Namespace("ref_teacher", model_version="1", outputs=("LOGITS", "V"), dtype="float32")


# ---------------------------------------------------------------------------------------- helpers


def _flip(path: Path, start: int, n: int = FLIP) -> None:
    """Invert ``n`` bytes of the file from ``start``, in place (what bit rot or a bad copy does)."""
    data = bytearray(path.read_bytes())
    assert start >= 0 and start + n <= len(data)
    data[start : start + n] = bytes(b ^ 0xFF for b in data[start : start + n])
    path.write_bytes(bytes(data))


def _only_shard(store: Path) -> Path:
    (shard,) = sorted((store / "shards").iterdir())
    return shard


def _rows_touching(shard: Path, lo: int, hi: int) -> list[int]:
    """Rows of the shard whose stored bytes (key, or any output value) lie in the file's bytes [lo, hi),
    found from Arrow's own buffer addresses over the file (independently of the store's code)."""
    whole = pa.py_buffer(shard.read_bytes())
    reader = pa.ipc.open_file(whole)
    hit: set[int] = set()
    first = 0
    for i in range(reader.num_record_batches):
        rb = reader.get_batch(i)
        for col in rb.columns:
            arr = col.flatten() if pa.types.is_fixed_size_list(col.type) else col
            if pa.types.is_large_list(col.type):
                offsets = col.offsets.to_numpy()
                arr = col.values
            else:
                offsets = np.arange(len(rb) + 1) * (len(arr) // len(rb))
            size = arr.type.bit_width // 8
            start = arr.buffers()[1].address - whole.address + arr.offset * size
            for row in range(len(rb)):
                a, b = start + int(offsets[row]) * size, start + int(offsets[row + 1]) * size
                if a < hi and lo < b:
                    hit.add(first + row)
        first += len(rb)
    return sorted(hit)


def _value_offset(shard: Path, column: str) -> int:
    """Where the values of a fixed-shape column start in the shard file."""
    whole = pa.py_buffer(shard.read_bytes())
    values = pa.ipc.open_file(whole).get_batch(0).column(column).flatten()
    return int(values.buffers()[1].address - whole.address)


def _footer(shard: Path) -> tuple[int, int]:
    """The byte range of the Arrow file's footer (its schema and record batch locations)."""
    data = shard.read_bytes()
    assert data[-6:] == b"ARROW1"
    length = int.from_bytes(data[-10:-6], "little")
    return len(data) - 10 - length, len(data) - 10


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`distill cache ...` as its own process."""
    return subprocess.run([sys.executable, "-m", "distill.cli", "cache", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`distill cache ...` through its entry point in this process: (exit status, stdout, stderr). An
    exception escaping it (a traceback in a process) fails the test."""
    from distill.cli import main

    capsys.readouterr()
    code = main(["cache", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


# ------------------------------------------------------------------------ the store on its own


def _write_records(path: Path, n: int = 5) -> list[np.ndarray]:
    """One shard holding ``n`` records (appends) of 10 keys, a fixed and a variable output each."""
    keys = [np.arange(i * 10, (i + 1) * 10) for i in range(n)]
    with TeacherOutputStore.open(path, NS, mode="a") as store, store.writer() as w:
        for k in keys:
            w.append(k, {"LOGITS": torch.as_tensor(k, dtype=torch.float32)[:, None] * torch.ones(4),
                         "V": [torch.full((int(x) % 3 + 1, 2), float(x)) for x in k]})
    return keys


def test_a_damaged_record_is_an_error_naming_shard_and_keys_and_a_later_copy_is_served(tmp_path: Path) -> None:
    keys = _write_records(tmp_path)
    shard = _only_shard(tmp_path)
    # Flip row 25's LOGITS (4 float32: 16 bytes), in the middle of record 2 (rows 20..29).
    row25 = _value_offset(shard, "LOGITS") + 25 * 16
    assert _rows_touching(shard, row25, row25 + 16) == [25]
    _flip(shard, row25, 16)

    store = TeacherOutputStore.open(tmp_path, NS)
    good = store.lookup(keys[0])
    assert good.all_hit and torch.equal(good.tensor("LOGITS")[:, 0], torch.arange(10, dtype=torch.float32))
    for _ in range(2):  # the second time too: a damaged record is never a plain miss
        with pytest.raises(DamagedRecordError) as err:
            store.lookup(keys[2])
        assert err.value.shard == str(shard) and err.value.keys == keys[2].tolist()
        assert str(shard) in str(err.value) and "distill cache verify" in str(err.value)
    with pytest.raises(DamagedRecordError):  # one damaged key among intact ones
        store.lookup([5, 21, 44])
    found = store.lookup([5, 21, 44], damaged="miss")
    assert found.hit.tolist() == [True, False, True] and found.damaged == {str(shard): [21]}
    assert found.tensor("LOGITS")[:, 0].tolist() == [5.0, 44.0]

    # A later copy of the damaged keys (what read_write stores) is served, by this and by a new instance.
    with TeacherOutputStore.open(tmp_path, NS, mode="a") as w_store, w_store.writer() as w:
        k = keys[2]
        w.append(k, {"LOGITS": torch.as_tensor(k, dtype=torch.float32)[:, None] * torch.ones(4),
                     "V": [torch.full((int(x) % 3 + 1, 2), float(x)) for x in k]})
    store.refresh()
    for s in (store, TeacherOutputStore.open(tmp_path, NS)):
        again = s.lookup(keys[2])
        assert again.all_hit and not again.damaged
        assert torch.equal(again.tensor("LOGITS")[:, 0], torch.arange(20, 30, dtype=torch.float32))
        assert [int(v[0, 0]) for v in again.ragged("V").unbind()] == list(range(20, 30))
    verified = TeacherOutputStore.open(tmp_path, NS).verify()
    assert [(d.shard, d.keys) for d in verified.damaged] == [(str(shard), tuple(range(20, 30)))]
    assert verified.records == 6 and not verified.ok


def test_a_store_written_before_checksums_is_read_with_one_warning_and_verify_calls_it_unverifiable(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    keys = _write_records(tmp_path, 2)
    shard = _only_shard(tmp_path)
    # Rewrite the shard as the first format wrote it: format version 1, no checksums anywhere.
    table = pa.ipc.open_file(pa.py_buffer(shard.read_bytes())).read_all()
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if not k.endswith(b"crc32")}
    meta[b"distill.cache.format"] = b"distill-teacher-outputs/1"
    table = table.replace_schema_metadata(meta)
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)

    with caplog.at_level(logging.WARNING, logger="distill.cache"):
        store = TeacherOutputStore.open(tmp_path, NS)
        TeacherOutputStore.open(tmp_path, NS)
    warned = [r.getMessage() for r in caplog.records if "before record checksums" in r.getMessage()]
    assert len(warned) == 1 and "read unverified" in warned[0]
    found = store.lookup(keys[1])
    assert found.all_hit and torch.equal(found.tensor("LOGITS")[:, 0], torch.arange(10, 20, dtype=torch.float32))

    assert cache_cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"unverified  {shard}" in out and "0 damaged records" in out and "1 unverifiable shards" in out


# ------------------------------------------------------------------- recorded through a teacher


@pytest.fixture(scope="module")
def teacher() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                       batching=BatchingConfig(max_batch_size=8, max_queue_delay_us=200))
    with ServerThread(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def recorded(teacher: ServerThread, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, list[torch.Tensor]]:
    """A store of 20 batches recorded through the teacher (one shard), and the outputs it served."""
    path = tmp_path_factory.mktemp("recorded") / "kd"
    with DistillReader(_batches(BATCHES), teachers=teacher.url, inputs=["X"], outputs=["Y"], cache=str(path),
                       cache_mode="read_write", key="index", no_teacher_timeout=5.0) as reader:
        outputs = [out["Y"].clone() for _, out in reader]
    assert len(outputs) == BATCHES and len(list((path / "shards").iterdir())) == 1
    return path, outputs


def _damaged_copy(recorded: tuple[Path, list[torch.Tensor]], tmp_path: Path) -> tuple[Path, Path, list[int]]:
    """A copy of the recorded store with 64 bytes flipped in the middle of its shard; (store, shard,
    damaged batches)."""
    store = tmp_path / "kd"
    shutil.copytree(recorded[0], store)
    shard = _only_shard(store)
    middle = shard.stat().st_size // 2 - FLIP // 2
    batches = sorted({row // ROWS for row in _rows_touching(shard, middle, middle + FLIP)})
    assert batches, "the middle of the shard holds no stored values: the test would check nothing"
    _flip(shard, middle)
    return store, shard, batches


def _read_offline(store: Path) -> DistillReader:
    return DistillReader(_batches(BATCHES), inputs=["X"], outputs=["Y"], cache=str(store), cache_mode="read",
                         key="index")


def test_read_mode_raises_naming_shard_and_key_at_the_damaged_batch(
        recorded: tuple[Path, list[torch.Tensor]], tmp_path: Path) -> None:
    store, shard, damaged = _damaged_copy(recorded, tmp_path)
    first = damaged[0]
    served: list[torch.Tensor] = []
    with _read_offline(store) as reader, pytest.raises(DamagedRecordError) as err:
        for _, out in reader:
            served.append(out["Y"])
            assert len(served) <= BATCHES
    assert len(served) == first, f"the pass should end at batch {first}, the first damaged one"
    for i, y in enumerate(served):
        assert torch.equal(y, recorded[1][i]), f"batch {i} differs from what was recorded"
    assert err.value.shard == str(shard)
    assert set(err.value.keys) <= set(range(first * ROWS, (first + 1) * ROWS)) and err.value.keys
    assert str(shard) in str(err.value) and repr(err.value.keys[0]) in str(err.value)
    assert "distill cache verify" in str(err.value) and "read_write" in str(err.value)


def test_read_write_recomputes_and_rewrites_the_damaged_record(
        recorded: tuple[Path, list[torch.Tensor]], teacher: ServerThread, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store, shard, damaged = _damaged_copy(recorded, tmp_path)
    before = _inference_count(teacher.url)
    with caplog.at_level(logging.WARNING, logger="distill.cache"), DistillReader(
            _batches(BATCHES), teachers=teacher.url, inputs=["X"], outputs=["Y"], cache=str(store),
            cache_mode="read_write", key="index", no_teacher_timeout=5.0) as reader:
        again = [out["Y"].clone() for _, out in reader]
    assert _inference_count(teacher.url) - before == len(damaged) * ROWS, "only the damaged batches are recomputed"
    assert all(torch.equal(a, b) for a, b in zip(again, recorded[1], strict=True))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "recompute" in said and str(shard) in said

    # The replay afterwards, from the store alone, equals the original recording.
    with _read_offline(store) as reader:
        replay = [out["Y"] for _, out in reader]
    assert len(replay) == BATCHES
    for i, (a, b) in enumerate(zip(replay, recorded[1], strict=True)):
        assert torch.equal(a, b), f"batch {i} of the replay differs from the recording"
    assert len(list((store / "shards").iterdir())) == 2


def test_verify_names_the_damaged_record_and_fails_and_passes_an_intact_store(
        recorded: tuple[Path, list[torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    intact = _cli("verify", str(recorded[0]))  # the command as its own process, once
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert f"{BATCHES} records ({BATCHES * ROWS} rows) checked: 0 damaged records" in intact.stdout

    store, shard, damaged = _damaged_copy(recorded, tmp_path)
    code, out, err = _in_process(capsys, "verify", str(store))
    assert code == 1, out + err
    lines = [line for line in out.splitlines() if line.startswith("damaged     ")]
    assert len(lines) == len(damaged)
    for line, batch in zip(lines, damaged, strict=True):
        assert str(shard) in line and f"keys {batch * ROWS}, {batch * ROWS + 1}," in line, line
    assert f"{len(damaged)} damaged records" in out


def test_a_damaged_footer_is_a_clear_error_not_a_crash(
        recorded: tuple[Path, list[torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "kd"
    shutil.copytree(recorded[0], store)
    shard = _only_shard(store)
    lo, hi = _footer(shard)
    assert hi - lo > 2 * FLIP
    _flip(shard, (lo + hi) // 2 - FLIP // 2)

    code, out, stderr = _in_process(capsys, "verify", str(store))
    assert code == 1, out + stderr
    assert f"damaged     {shard}" in out and "none of it is read" in out
    code, out, stderr = _in_process(capsys, "info", str(store))
    assert code == 0 and "1 rejected" in out and "DamagedShardError" in out, out + stderr

    with _read_offline(store) as reader, pytest.raises(CacheMissError) as err:
        next(iter(reader))
    assert shard.name in str(err.value) and "distill cache verify" in str(err.value)


def test_bytes_keyed_and_compressed_shards_are_checked_too(tmp_path: Path) -> None:
    keys = [f"sample-{i}" for i in range(30)]
    with TeacherOutputStore.open(tmp_path, NS, mode="a", key_type="bytes") as store, \
            store.writer(compression="zstd") as w:
        for i in range(0, 30, 10):
            w.append(keys[i : i + 10], {"LOGITS": torch.arange(40, dtype=torch.float32).view(10, 4) + i,
                                        "V": [torch.ones(2, 2) * (i + j) for j in range(10)]})
    store = TeacherOutputStore.open(tmp_path, NS)
    assert store.verify().ok and store.lookup(keys).all_hit
    # Compressed buffers fail to decompress (the shard is not read), or decompress to other bytes (a
    # damaged record): never a wrong answer.
    shard = _only_shard(tmp_path)
    _flip(shard, shard.stat().st_size // 2 - 8, 16)
    damaged = TeacherOutputStore.open(tmp_path, NS)
    try:
        found = damaged.lookup(keys)
    except DamagedRecordError as e:
        assert e.shard == str(shard)
    else:
        assert damaged.damaged_shards == [shard.name] and not found.hit.any()
    assert not damaged.verify().ok
