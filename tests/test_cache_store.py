"""The teacher-output store (distill.cache): round trips, namespaces, concurrent writers, crashes, zero-copy, CLI.

Writers that must be separate processes (concurrency, SIGKILL mid-write) are real subprocesses
running the store's code; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch

from distill.cache import (
    CacheError,
    Namespace,
    NamespaceMismatchError,
    Ragged,
    SchemaMismatchError,
    StoreClosedError,
    StoreNotFoundError,
    TeacherOutputStore,
    id_dtype,
)
from distill.cache import cli as cache_cli

REPO = Path(__file__).resolve().parents[1]
NS = Namespace("ref_teacher", model_version="1", outputs=("LOGITS",), dtype="float32", temperature=4.0)


def fixed_out(keys: np.ndarray) -> torch.Tensor:
    """A value that depends only on the key, so any process can check what another wrote."""
    k = torch.as_tensor(keys, dtype=torch.float32).unsqueeze(1)
    return k * 10 + torch.arange(4, dtype=torch.float32)


def var_out(keys: np.ndarray) -> list[torch.Tensor]:
    return [torch.full((int(k) % 5 + 1, 3), float(k), dtype=torch.float16) for k in keys]


def write(store: TeacherOutputStore, keys: np.ndarray, compression: Literal["zstd"] | None = None) -> None:
    with store.writer(compression=compression) as w:
        w.append(keys, {"LOGITS": fixed_out(keys), "V": var_out(keys)})


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so NaN payloads and signed zeros compare exactly."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


_CHILD_PRELUDE = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from distill.cache import Namespace, TeacherOutputStore
    NS = Namespace("ref_teacher", model_version="1", outputs=("LOGITS",), dtype="float32", temperature=4.0)
    def fixed_out(keys):
        k = torch.as_tensor(keys, dtype=torch.float32).unsqueeze(1)
        return k * 10 + torch.arange(4, dtype=torch.float32)
    def var_out(keys):
        return [torch.full((int(k) % 5 + 1, 3), float(k), dtype=torch.float16) for k in keys]
    store = TeacherOutputStore.open(sys.argv[1], NS, mode="a")
    """
)


def _readline(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    """One line of the child's stdout, read unbuffered (so a second line is never swallowed by a buffer)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"child printed no whole line in {timeout} s (got {line!r}; exit status {proc.poll()})"
        chunk = os.read(fd, 1)
        assert chunk, f"child closed stdout after {line!r} (exit status {proc.wait(timeout=60)})"
        line += chunk
    return line.decode().strip()


# --------------------------------------------------------------------------------------- basics


def test_hit_partial_hit_and_miss(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(0, 20))
    assert store.refresh() == 1
    assert len(store) == 20

    full = store.lookup([3, 7, 19])
    assert full.all_hit and full.n_hits == 3
    torch.testing.assert_close(full.outputs["LOGITS"], fixed_out(np.array([3, 7, 19])))
    v = full.outputs["V"]
    assert isinstance(v, Ragged)
    assert v.lengths.tolist() == [4, 3, 5]
    for got, want in zip(v.unbind(), var_out(np.array([3, 7, 19])), strict=True):
        assert torch.equal(got, want)

    partial = store.lookup(torch.tensor([5, 100, 2, -1]))
    assert partial.hit.tolist() == [True, False, True, False]
    assert partial.miss_indices.tolist() == [1, 3]
    torch.testing.assert_close(partial.outputs["LOGITS"], fixed_out(np.array([5, 2])))
    assert isinstance(partial.outputs["V"], Ragged)
    assert torch.equal(partial.outputs["V"][1], var_out(np.array([2]))[0])

    miss = store.lookup([1000, 1001])
    assert not miss.hit.any()
    assert miss.tensor("LOGITS").shape == (0, 4)
    assert len(miss.ragged("V")) == 0
    with pytest.raises(TypeError, match=r"lookup\.ragged"):
        miss.tensor("V")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int16, torch.uint16]
)
def test_fixed_and_variable_round_trip_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 12
    if dtype.is_floating_point:
        fixed = torch.randn(n, 5, 7, generator=gen).to(dtype)
        fixed[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")]).to(dtype)
        ragged = [torch.randn(int(t), 8, generator=gen).to(dtype) for t in torch.randint(1, 30, (n,), generator=gen)]
    else:
        lo, hi = (0, 1 << 16) if dtype == torch.uint16 else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        fixed = torch.randint(lo, hi, (n, 5, 7), generator=gen, dtype=torch.int64).to(dtype)
        ragged = [
            torch.randint(lo, hi, (int(t), 8), generator=gen, dtype=torch.int64).to(dtype)
            for t in torch.randint(1, 30, (n,), generator=gen)
        ]
    keys = np.arange(100, 100 + n)
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    with store.writer(shard_max_rows=5, batch_bytes=1) as w:  # several shards, several record batches
        for lo in range(0, n, 3):
            w.append(keys[lo : lo + 3], {"F": fixed[lo : lo + 3], "R": ragged[lo : lo + 3]})
    store.refresh()
    assert store.output_specs["F"].shape == (5, 7) and store.output_specs["R"].shape == (-1, 8)

    reopened = TeacherOutputStore.open(tmp_path, NS)
    order = np.array([111, 100, 105, 106, 103, 110])  # across shards, out of order
    got = reopened.lookup(order)
    assert got.all_hit
    f = got.outputs["F"]
    assert isinstance(f, torch.Tensor) and f.dtype == dtype
    assert torch.equal(bits(f), bits(fixed[order - 100]))
    r = got.outputs["R"]
    assert isinstance(r, Ragged) and r.values.dtype == dtype
    for got_t, i in zip(r.unbind(), order - 100, strict=True):
        assert torch.equal(bits(got_t), bits(ragged[i]))
    padded = r.padded()
    assert padded.shape == (len(order), max(len(ragged[i]) for i in order - 100), 8)


def test_variable_outputs_accept_packed_and_same_length_forms(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    values = torch.arange(6 * 2, dtype=torch.int16).view(6, 2)
    with store.writer() as w:
        w.append([0, 1, 2], {"IDS": Ragged(values, torch.tensor([1, 0, 5]))})  # packed, one sample empty
        w.append([3, 4], {"IDS": torch.ones(2, 3, 2, dtype=torch.int16)})  # [N, T, k]: all T equal
        with pytest.raises(SchemaMismatchError, match="does not fit"):
            w.append([5, 6], {"IDS": Ragged(values, torch.tensor([1, 1]))})
    store.refresh()
    got = store.lookup([2, 1, 0, 4]).ragged("IDS")
    assert got.lengths.tolist() == [5, 0, 1, 3]
    assert torch.equal(got[0], values[1:6]) and got[1].shape == (0, 2)
    assert torch.equal(got[2], values[:1]) and torch.equal(got[3], torch.ones(3, 2, dtype=torch.int16))
    assert torch.equal(got[-1], got[3])
    with pytest.raises(IndexError):
        got[4]


def test_id_dtype_is_the_smallest_that_holds_the_vocabulary() -> None:
    assert id_dtype(32_000) == torch.int16  # Llama 2
    assert id_dtype(50_257) == torch.uint16  # GPT-2
    assert id_dtype(1 << 16) == torch.uint16
    assert id_dtype(128_256) == torch.int32  # Llama 3


def test_bytes_keys_hashes_and_strings(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a", key_type="bytes")
    keys = [b"a", "bc", b"a\x00", bytes(range(32))]  # b"a" and b"a\0" must stay distinct
    with store.writer() as w:
        w.append(keys, {"X": torch.arange(4, dtype=torch.int32)})
    store.refresh()
    got = store.lookup([b"a\x00", b"longer than any stored key at all", "a", bytes(range(32)), b"b"])
    assert got.hit.tolist() == [True, False, True, True, False]
    assert got.tensor("X").tolist() == [2, 0, 3]
    with pytest.raises(TypeError, match="int64"):
        TeacherOutputStore.open(tmp_path / "ints", NS, mode="a").lookup(["not-an-int"])


def test_namespace_mismatch_is_refused_with_the_differing_fields(tmp_path: Path) -> None:
    TeacherOutputStore.open(tmp_path, NS, mode="a")
    other = Namespace("ref_teacher", model_version="2", outputs=("LOGITS",), dtype="float32", temperature=2.0)
    with pytest.raises(NamespaceMismatchError) as err:
        TeacherOutputStore.open(tmp_path, other, mode="a")
    assert err.value.fields == ("model_version", "temperature")
    msg = str(err.value)
    assert "model_version: store has '1', asked for '2'" in msg
    assert "temperature: store has 4.0, asked for 2.0" in msg
    assert "distill cache info" in msg
    with pytest.raises(NamespaceMismatchError, match="keyed by int64"):
        TeacherOutputStore.open(tmp_path, NS, mode="a", key_type="bytes")
    # Reading without a namespace accepts what the store holds (as `distill cache info` does).
    assert TeacherOutputStore.open(tmp_path).namespace == NS
    with pytest.raises(StoreNotFoundError, match="no teacher-output store"):
        TeacherOutputStore.open(tmp_path / "nowhere", NS)


def test_appends_must_keep_the_stored_schema(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(4))
    store.refresh()
    with store.writer() as w:
        with pytest.raises(SchemaMismatchError, match="differ"):
            w.append(np.arange(10, 12), {"LOGITS": fixed_out(np.arange(10, 12)).half(), "V": var_out(np.arange(2))})
        with pytest.raises(SchemaMismatchError, match="differ"):
            w.append(np.arange(10, 12), {"LOGITS": fixed_out(np.arange(10, 12))})
        with pytest.raises(SchemaMismatchError, match="empty per-sample shape"):
            w.append(np.arange(10, 12), {"LOGITS": torch.zeros(2, 0), "V": var_out(np.arange(2))})
        with pytest.raises(SchemaMismatchError, match="one per key"):
            w.append(np.arange(10, 12), {"LOGITS": fixed_out(np.arange(3)), "V": var_out(np.arange(2))})
    with pytest.raises(CacheError, match="open for reading"):
        TeacherOutputStore.open(tmp_path, NS).writer()


def test_duplicates_resolve_to_the_first_sealed_copy(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    first = store.writer()
    second = store.writer()
    first.append([1, 2], {"X": torch.tensor([10.0, 20.0])})
    second.append([2, 3], {"X": torch.tensor([99.0, 30.0])})
    second.seal()  # sealed first, although started second
    first.seal()
    store.refresh()
    assert len(store) == 3
    assert store.lookup([1, 2, 3]).tensor("X").tolist() == [10.0, 99.0, 30.0]
    info = store.info()
    assert (info.samples, info.rows, info.duplicates) == (3, 4, 1)
    # Every process that sees the same shards resolves the same way.
    again = TeacherOutputStore.open(tmp_path, NS)
    assert again.lookup([2]).tensor("X").tolist() == [99.0]


def test_refresh_sees_a_shard_sealed_after_open(tmp_path: Path) -> None:
    writer_side = TeacherOutputStore.open(tmp_path, NS, mode="a")
    reader = TeacherOutputStore.open(tmp_path, NS)
    assert not reader.lookup([1]).hit.any()
    w = writer_side.writer()
    w.append([1, 2], {"X": torch.tensor([1.0, 2.0])})
    assert reader.refresh() == 0  # appended but not sealed: invisible
    assert not reader.lookup([1]).hit.any()
    w.seal()
    assert reader.refresh() == 1
    assert reader.lookup([1, 2]).all_hit
    assert reader.refresh() == 0


def test_an_aborted_shard_is_never_seen(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    w = store.writer(batch_bytes=1)
    w.append([1, 2], {"X": torch.tensor([1.0, 2.0])})
    assert len(store.unsealed()) == 1
    w.abort()
    w.close()  # nothing left to seal
    assert store.refresh() == 0 and not store.unsealed() and not w.sealed
    assert not store.lookup([1, 2]).hit.any()
    with pytest.raises(StoreClosedError, match="closed"):
        w.append([3], {"X": torch.tensor([3.0])})


def test_compressed_shards_round_trip(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(50), compression="zstd")
    store.refresh()
    got = store.lookup(np.arange(49, -1, -1))
    torch.testing.assert_close(got.outputs["LOGITS"], fixed_out(np.arange(49, -1, -1)))


# --------------------------------------------------------------------------------- zero-copy


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_contiguous_reads_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(100))
    store.refresh()
    (shard,) = (tmp_path / "shards").iterdir()
    ranges = _mapped_ranges(shard)
    assert ranges, "the shard is not memory-mapped"

    def in_map(t: torch.Tensor) -> bool:
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(a <= lo and hi <= b for a, b in ranges)

    run = store.lookup(np.arange(10, 42))  # consecutive rows of one shard: no copy
    assert in_map(run.tensor("LOGITS"))
    assert in_map(run.ragged("V").values)
    torch.testing.assert_close(run.outputs["LOGITS"], fixed_out(np.arange(10, 42)))

    shuffled = store.lookup([42, 10, 77])  # a gather: one copy into new memory
    assert not in_map(shuffled.tensor("LOGITS"))

    # Writing into a returned view changes this process's private page, never the file.
    view = run.outputs["LOGITS"]
    assert isinstance(view, torch.Tensor)
    view.fill_(-1.0)
    fresh = TeacherOutputStore.open(tmp_path, NS).lookup(np.arange(10, 42))
    torch.testing.assert_close(fresh.outputs["LOGITS"], fixed_out(np.arange(10, 42)))


# ------------------------------------------------------------------------------- processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_writer_processes_then_every_sample_exactly_once(tmp_path: Path) -> None:
    TeacherOutputStore.open(tmp_path, NS, mode="a")  # created once; the children open it
    script = _CHILD_PRELUDE + textwrap.dedent(
        """
        lo, hi = int(sys.argv[2]), int(sys.argv[3])
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"  # both start writing together
        with store.writer(shard_max_rows=32) as w:
            for start in range(lo, hi, 8):
                keys = np.arange(start, min(start + 8, hi))
                w.append(keys, {"LOGITS": fixed_out(keys), "V": var_out(keys)})
        print(len(w.sealed), flush=True)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path), str(lo), str(hi)],
            env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
        )
        for lo, hi in ((0, 300), (200, 500))  # 100 keys written by both
    ]
    try:
        for p in procs:
            assert _readline(p) == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert int(out) >= 8  # each wrote several shards
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)

    store = TeacherOutputStore.open(tmp_path, NS)
    info = store.info()
    assert info.samples == 500 and info.rows == 600 and info.duplicates == 100
    assert not info.unsealed and not info.rejected
    keys = np.arange(500)
    got = store.lookup(keys)
    assert got.all_hit
    torch.testing.assert_close(got.outputs["LOGITS"], fixed_out(keys))
    v = got.outputs["V"]
    assert isinstance(v, Ragged)
    assert v.lengths.tolist() == [int(k) % 5 + 1 for k in keys]
    starts = v.offsets[:-1]
    assert torch.equal(v.values[starts, 0], torch.as_tensor(keys, dtype=torch.float16))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_writer_sigkilled_mid_shard_leaves_the_store_readable(tmp_path: Path) -> None:
    script = _CHILD_PRELUDE + textwrap.dedent(
        """
        w = store.writer(batch_bytes=1)  # every append reaches the file
        keys = np.arange(50)
        w.append(keys, {"LOGITS": fixed_out(keys), "V": var_out(keys)})
        w.seal()
        print("sealed", flush=True)
        for i in range(200000):
            keys = np.arange(1000 + 10 * i, 1010 + 10 * i)
            w.append(keys, {"LOGITS": fixed_out(keys), "V": var_out(keys)})
            if i == 20:
                print("writing", flush=True)
        sys.stdin.read()  # still holding the unsealed shard open when killed
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
    )
    try:
        assert _readline(proc) == "sealed"
        assert _readline(proc) == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)

    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    info = store.info()
    assert info.samples == 50 and len(info.shards) == 1 and not info.rejected
    (torn,) = info.unsealed
    assert torn.state == "torn" and torn.bytes > 0
    got = store.lookup(np.array([0, 49, 1000, 1005]))
    assert got.hit.tolist() == [True, True, False, False]  # the torn shard's samples are misses again
    torch.testing.assert_close(got.outputs["LOGITS"], fixed_out(np.array([0, 49])))
    # The store keeps taking writes, and the torn file can be cleaned up.
    write(store, np.arange(1000, 1010))
    assert store.refresh() == 1 and store.lookup([1005]).all_hit
    assert store.remove_torn() == [torn.name]
    assert not store.info().unsealed


def test_a_damaged_sealed_shard_is_ignored_and_reported(tmp_path: Path) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(10))
    write(store, np.arange(10, 20))
    (good, victim) = sorted((tmp_path / "shards").iterdir())
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # e.g. a partial copy between machines
    reopened = TeacherOutputStore.open(tmp_path, NS)
    info = reopened.info()
    assert info.samples == 10 and [n for n, _, _ in info.shards] == [good.name]
    assert [n for n, _ in info.rejected] == [victim.name]
    assert reopened.lookup([5, 15]).hit.tolist() == [True, False]


# -------------------------------------------------------------------------------------- CLI


def test_cache_info_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = TeacherOutputStore.open(tmp_path, NS, mode="a")
    write(store, np.arange(30))
    (tmp_path / "tmp" / "otherhost.123.abcd-000000.arrow.partial").write_bytes(b"ARROW1")

    assert cache_cli.main(["info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "teacher    ref_teacher version 1" in text
    assert "temperature=4.0" in text
    assert "samples    30" in text
    assert "per sample" in text and "B" in text
    tokens = sum(int(k) % 5 + 1 for k in range(30))
    assert f"({tokens:,} tokens)" in text
    assert "shards     1 sealed, 1 unsealed, 0 rejected" in text
    assert "LOGITS float32[4], V float16[T, 3]" in text

    assert cache_cli.main(["info", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["samples"] == 30 and doc["tokens"] == tokens
    assert doc["bytes_per_sample"] == pytest.approx(doc["bytes"] / 30)
    assert doc["namespace"]["model_name"] == "ref_teacher"
    assert doc["unsealed"][0]["state"] == "unknown"

    assert cache_cli.main(["info", str(tmp_path / "missing")]) == 1
    assert "no teacher-output store" in capsys.readouterr().err
