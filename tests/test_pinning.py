"""`benchmarks.pinning`: core lists as `taskset -c` writes them, the checks that keep the server's
and the load generator's cores apart, and affinity that a thread gives the threads it starts."""

from __future__ import annotations

import importlib
import os
import threading

import pytest

from benchmarks.pinning import CpuListError, check_split, on_cores, parse_cpu_list, pin_process


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,4", (0, 1, 4)), (" 3 , 1-2 ", (1, 2, 3)), ("2,2", (2,)),
])
def test_core_lists_read_as_taskset_writes_them(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "says"), [
    ("", "not a core list"), ("a-b", "not a core list"), ("3-1", "first <= last"), ("-1", "not a core list"),
])
def test_a_bad_core_list_says_how_to_write_one(text: str, says: str) -> None:
    with pytest.raises(CpuListError, match=says):
        parse_cpu_list(text)


def test_the_split_needs_both_sides_apart_and_on_this_process_cores() -> None:
    mine = sorted(os.sched_getaffinity(0))
    with pytest.raises(CpuListError, match="give both"):
        check_split(mine[:1], [])
    with pytest.raises(CpuListError, match="in both"):
        check_split(mine[:1], mine[:1])
    beyond = max(mine) + 1000
    with pytest.raises(CpuListError, match=rf"\[{beyond}\] are not among this process's"):
        check_split([beyond], mine[:1])


def test_a_thread_started_on_pinned_cores_keeps_them_and_pin_process_moves_every_thread() -> None:
    mine = os.sched_getaffinity(0)
    core = min(mine)
    seen: list[set[int]] = []
    with on_cores([core]):
        worker = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        worker.start()
        worker.join(10)
    assert seen == [{core}] and os.sched_getaffinity(0) == mine
    release = threading.Event()
    waiting = threading.Thread(target=release.wait, args=(10,))
    waiting.start()
    try:
        pin_process([core])
        assert os.sched_getaffinity(waiting.native_id or 0) == {core} and os.sched_getaffinity(0) == {core}
    finally:
        pin_process(mine)
        release.set()
        waiting.join(10)
    assert os.sched_getaffinity(0) == mine


@pytest.mark.parametrize("bench", ["serving", "grpc_floor"])
def test_the_serving_benchmarks_refuse_one_side_alone_or_cores_they_may_not_use(
        bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"benchmarks.{bench}")
    beyond = max(os.sched_getaffinity(0)) + 1000
    for args, says in ((["--server-cpus", "0"], "give both --server-cpus and --client-cpus"),
                       (["--server-cpus", str(beyond), "--client-cpus", "0"], "are not among this process's")):
        with pytest.raises(SystemExit) as e:
            module.parse_args(args)
        assert e.value.code == 2 and says in capsys.readouterr().err
    mine = sorted(os.sched_getaffinity(0))
    assert module.parse_args([]).server_cpus == ()
    if len(mine) > 1:
        s = module.parse_args(["--server-cpus", str(mine[-1]), "--client-cpus", str(mine[0])])
        assert (s.server_cpus, s.client_cpus) == ((mine[-1],), (mine[0],))
