"""Helpers for tests that run a real etcd (``discovery.local_etcd.LocalEtcd``).

No pytest-asyncio here: async test bodies run through :func:`arun`, which also bounds them in time.
Every wait below is bounded in time, and every process or socket opened is closed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aetcd

from discovery.base import TeacherSet, TeacherWatch
from discovery.local_etcd import LocalEtcd
from protos import registry_pb2

_T = TypeVar("_T")

REPO = Path(__file__).resolve().parent.parent


def arun(coro: Coroutine[Any, Any, _T], timeout: float = 30.0) -> _T:
    """Run ``coro`` in a fresh event loop, failing the test after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def unique_service(prefix: str = "svc") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def record(instance_id: str, port: int = 9000, **fields: Any) -> registry_pb2.TeacherRecord:
    return registry_pb2.TeacherRecord(instance_id=instance_id, endpoint=f"127.0.0.1:{port}", model_name="m", **fields)


async def next_matching(
    watch: TeacherWatch, predicate: Callable[[TeacherSet], bool], timeout: float = 10.0
) -> TeacherSet:
    """The first snapshot from ``watch`` (the current one included) that satisfies ``predicate``."""
    current = watch.current
    if current is not None and predicate(current):
        return current

    async def scan() -> TeacherSet:
        async for snap in watch:
            if predicate(snap):
                return snap
        raise AssertionError("the watch ended before the expected snapshot arrived")

    try:
        return await asyncio.wait_for(scan(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"no matching snapshot within {timeout} s; last one: {watch.current!r}") from None


def ids(*names: str) -> Callable[[TeacherSet], bool]:
    """Predicate: the snapshot holds exactly these instance ids."""
    want = set(names)
    return lambda snap: set(snap) == want


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``check`` every 50 ms until it is true; return the seconds it took."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not true within {timeout} s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def raw_client(etcd: LocalEtcd) -> Any:
    """A plain aetcd client for the test's own writes, deletes and compactions."""
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port, timeout=5)
    try:
        yield client
    finally:
        await client.close()
        await asyncio.sleep(0.05)  # let gRPC report the cancelled calls while this loop still runs


def spawn_teacher(
    address: str, service: str, instance_id: str, *, ttl: float, port: int = 9000
) -> subprocess.Popen[bytes]:
    """A separate process that registers a teacher (``python -m discovery register``) and holds the
    registration until killed. Its output goes to a temporary file (see ``.log_path``)."""
    log = tempfile.NamedTemporaryFile(prefix="teacher-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "discovery",
            "register",
            "--registry",
            address,
            "--service",
            service,
            "--instance-id",
            instance_id,
            "--endpoint",
            f"127.0.0.1:{port}",
            "--ttl",
            str(ttl),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log.close()
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` if it still runs, wait for it, remove its log."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    with contextlib.suppress(OSError, AttributeError):
        os.unlink(proc.log_path)  # type: ignore[attr-defined]


class TcpProxy:
    """A loopback TCP proxy that can cut every connection and refuse new ones, then come back on
    the same port: a network partition between one client and etcd, while etcd keeps running."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports.update((writer.transport, up_writer.transport))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        for coro in (pipe(reader, up_writer), pipe(up_reader, writer)):
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._transports):
            t.abort()
        self._transports.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.sleep(0.05)

    async def resume(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()


def enable_root_auth(server: LocalEtcd, password: str = "rootpw") -> None:
    """Turn on etcd authentication with one user, root (role root), on a running LocalEtcd."""
    import aetcd.rpc as etcd_rpc
    import grpc

    async def enable() -> None:
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            auth = etcd_rpc.AuthStub(channel)
            await auth.UserAdd(etcd_rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
            await auth.RoleAdd(etcd_rpc.AuthRoleAddRequest(name="root"), timeout=5)
            await auth.UserGrantRole(etcd_rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            await auth.AuthEnable(etcd_rpc.AuthEnableRequest(), timeout=5)

    arun(enable())
