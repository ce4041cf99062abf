"""Running `distill register` as an operator does, for the registrar's tests: a process of its own
with its log, the service's records read back from the real etcd, a bounded wait with the logs' tails
when it times out, and a stop by signal."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from discovery import open_registry
from discovery.base import TeacherEntry
from discovery.errors import RegistryUnavailableError
from discovery.local_etcd import LocalEtcd
from protos import registry_pb2
from teacher_server import launch
from tests.etcd_fixtures import arun

_T = TypeVar("_T")
REPO = Path(__file__).resolve().parent.parent
FAST = ["--probe-interval", "0.2", "--unhealthy-after", "3", "--ttl", "5", "--probe-timeout", "2"]
# What a registrar declares for an engine that speaks vLLM's HTTP protocol.
HTTP_CAPABILITIES = registry_pb2.Capabilities(declared=True, max_top_k=20, token_logprobs=True, score_ids=False,
                                              text_prompts=True, chunked=False, full_outputs=False, tail=True)


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return launch.spawn(argv, log=log, cwd=REPO, env={"PYTHONUNBUFFERED": "1"}, pdeathsig=True)


def run_registrar(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return spawn([sys.executable, "-m", "distill.cli", "register", "--log-level", "DEBUG", *FAST, *args], log)


def entries(etcd: LocalEtcd, service: str) -> dict[str, TeacherEntry]:
    """The service's records with their loads, read once (three tries: a loaded CI machine may miss
    one connection handshake)."""
    async def read() -> dict[str, TeacherEntry]:
        async with open_registry(etcd.address) as registry:
            snapshot = await registry.teachers(service)
            loads = await registry.loads(service)
            return {iid: TeacherEntry(e.record, loads.get(iid)) for iid, e in snapshot.items()}

    for attempt in range(3):
        try:
            return arun(read())
        except RegistryUnavailableError:
            if attempt == 2:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def until(check: Callable[[], _T | None], timeout: float, what: str, *logs: Path) -> _T:
    """Poll `check` every 0.1 s until it returns something truthy (returned); fail after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            tails = "\n".join(f"--- {p.name}:\n{launch.log_tail(p, 40)}" for p in logs)
            raise AssertionError(f"{what}: not within {timeout} s\n{tails}")
        time.sleep(0.1)


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    launch.stop(proc, grace=60.0)
