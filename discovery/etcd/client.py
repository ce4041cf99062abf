"""The connection to etcd: a TLS-capable ``aetcd`` client, endpoint failover, and deadline-bound calls.

Everything else in :mod:`discovery.etcd` (lease sessions, watches, the registry) talks to etcd only
through one :class:`EtcdConnection`: one gRPC channel and one watch stream per registry, a deadline
on every call, and a single place that decides when to move on to the next endpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.rpc as etcd_rpc
import aetcd.utils
import aetcd.watcher
import grpc

from discovery.address import DEFAULT_ETCD_PORT, Endpoint, RegistryAddress, parse_address, parse_endpoints
from discovery.aio import deadline
from discovery.base import RegistryError, RegistryUnavailableError

__all__ = [
    "CHANNEL_OPTIONS",
    "EtcdClient",
    "EtcdConnection",
    "EtcdFailure",
    "describe_error",
    "endpoints_of",
    "is_auth_error",
    "is_lease_lost",
    "read_file",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# gRPC channel settings: reconnect quickly after an etcd restart (the default backoff grows to 120 s),
# and detect a dead connection under a long-lived watch stream with HTTP/2 pings. etcd's server
# enforces a 5 s minimum ping interval and no pings without an active stream.
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}

# How long close() lets gRPC deliver the completions of the RPCs it cancelled.
_CLOSE_DRAIN = 0.05
# Extra time beyond the gRPC deadline before asyncio gives up on a call (covers connect + auth).
_CALL_SLACK = 1.0


class EtcdClient(aetcd.Client):
    """``aetcd.Client`` with TLS, IPv6 endpoints and no leaked channel when authentication fails.

    ``aetcd`` 1.0 always opens an insecure channel to ``f"{host}:{port}"``; this subclass opens a
    secure one when ``root_certificates`` or a client certificate is given and brackets IPv6 hosts.
    The TLS material and the resulting ``credentials`` stay readable as attributes.
    """

    _is_connecting: bool

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float | None = None,
        options: dict[str, Any] | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ) -> None:
        super().__init__(
            host=endpoint.host,
            port=endpoint.port,
            username=username,
            password=password,
            timeout=timeout,  # aetcd annotates int; any number works
            options=options,
        )
        self.endpoint = endpoint
        self.username = username
        self.root_certificates = root_certificates
        self.private_key = private_key
        self.certificate_chain = certificate_chain
        self.tls = any(x is not None for x in (root_certificates, private_key, certificate_chain))
        self.credentials: grpc.ChannelCredentials | None = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain) if self.tls else None
        )

    @property
    def target(self) -> str:
        return str(self.endpoint)

    async def connect(self) -> None:
        """Open the channel (and authenticate); same contract as ``aetcd.Client.connect``."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            async with deadline(self._connect_wait_timeout):
                await self._connected.wait()
            return
        self._is_connecting = True
        channel: grpc.aio.Channel | None = None
        try:
            opts = list(self._options.items())
            if self.credentials is not None:
                channel = grpc.aio.secure_channel(self.target, self.credentials, options=opts)
            else:
                channel = grpc.aio.insecure_channel(self.target, options=opts)
            metadata = None
            if self._username is not None and self._password is not None:
                auth = etcd_rpc.AuthStub(channel)
                try:
                    resp = await auth.Authenticate(
                        etcd_rpc.AuthenticateRequest(name=self._username, password=self._password),
                        timeout=self._timeout,
                    )
                except grpc.aio.AioRpcError as e:
                    aetcd.exceptions._handle_exception(e)
                metadata = (("token", resp.token),)
                self.auth_stub = auth
            self.channel = channel
            self.metadata = metadata
            self.kvstub = etcd_rpc.KVStub(channel)
            self.clusterstub = etcd_rpc.ClusterStub(channel)
            self.leasestub = etcd_rpc.LeaseStub(channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(channel)
            self._watcher = aetcd.watcher.Watcher(etcd_rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
            channel = None  # owned by the client now
            self._connected.set()
        finally:
            self._is_connecting = False
            if channel is not None:
                await channel.close()


def read_file(path: str | Path | None, what: str) -> bytes | None:
    """The bytes of a TLS file option (None stays None); a ``ValueError`` naming the option otherwise."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None


def endpoints_of(spec: str | Endpoint | RegistryAddress | Iterable[str | Endpoint]) -> tuple[Endpoint, ...]:
    """The etcd endpoints any accepted address form names, in order, without duplicates."""
    if isinstance(spec, RegistryAddress):
        if spec.scheme != "etcd":
            raise ValueError(f"EtcdRegistry needs an etcd:// address, not {str(spec)!r}")
        return spec.endpoints
    if isinstance(spec, Endpoint):
        return (spec,)
    if isinstance(spec, str):
        if "://" in spec:
            return endpoints_of(parse_address(spec))
        return parse_endpoints(spec, default_port=DEFAULT_ETCD_PORT)
    out: list[Endpoint] = []
    for item in spec:
        for ep in endpoints_of(item):
            if ep not in out:
                out.append(ep)
    if not out:
        raise ValueError("EtcdRegistry needs at least one endpoint")
    return tuple(out)


def describe_error(e: BaseException) -> str:
    """``CODE: details`` for a gRPC error, ``Type: message`` otherwise: what a log line shows."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if text != type(e).__name__ else text


def is_lease_lost(e: BaseException) -> bool:
    """etcd's answer for a lease that expired or was revoked (its keys are gone)."""
    return "lease not found" in str(e).lower()


def is_auth_error(e: BaseException) -> bool:
    """An expired or rejected authentication token: the client must be rebuilt to get a new one."""
    if isinstance(e, aetcd.exceptions.UnauthenticatedError):
        return True
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED:
        return True
    text = str(e).lower()
    return "invalid auth token" in text or "user name is empty" in text


@dataclass(frozen=True)
class EtcdFailure:
    """One failed exchange: the client it went through and what went wrong."""

    client: EtcdClient
    error: BaseException

    @property
    def endpoint(self) -> Endpoint:
        return self.client.endpoint

    def __str__(self) -> str:
        return describe_error(self.error)


class EtcdConnection:
    """The client for the current endpoint, with failover to the next one, and bounded calls.

    Everyone shares one client (one gRPC channel, one watch stream). A caller whose call failed
    reports it with :meth:`failed`; with several endpoints the next call then goes to the next
    endpoint. After an authentication error the client is rebuilt to get a fresh token.
    ``timeout`` bounds every call; ``retry_max_backoff`` caps the retry backoff of everyone who
    retries through this connection.
    """

    def __init__(
        self,
        endpoints: tuple[Endpoint, ...],
        factory: Callable[[Endpoint], EtcdClient],
        *,
        timeout: float,
        retry_max_backoff: float,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = float(timeout)
        self.retry_max_backoff = float(retry_max_backoff)
        self._factory = factory
        self._index = 0
        self._client: EtcdClient | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.closed = False

    def client(self) -> EtcdClient:
        """The client of the current endpoint, created on first use. Raises once closed."""
        if self.closed:
            raise RegistryError("the registry is closed")
        if self._client is None:
            self._client = self._factory(self.endpoints[self._index])
        return self._client

    def is_current(self, client: EtcdClient) -> bool:
        return client is self._client

    def failed(self, client: EtcdClient, error: BaseException) -> None:
        """``client`` failed with ``error``: move to the next endpoint (or rebuild after an auth
        error). Idempotent per client: only the first report about the current client counts."""
        if client is not self._client or self.closed:
            return  # someone else already moved on
        rebuild = is_auth_error(error)
        if len(self.endpoints) > 1:
            self._index = (self._index + 1) % len(self.endpoints)
            log.info(
                "etcd endpoint %s failed (%s); trying %s next",
                client.endpoint,
                describe_error(error),
                self.endpoints[self._index],
            )
            rebuild = True
        if rebuild:
            self._client = None
            task = asyncio.get_running_loop().create_task(self._close_client(client))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _close_client(client: EtcdClient) -> None:
        try:
            async with deadline(5.0):
                await client.close()
        except Exception as e:  # closing a broken channel may complain; nothing to do about it
            log.debug("closing etcd client for %s: %s", client.endpoint, describe_error(e))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)
        for task in list(self._retiring):
            await asyncio.wait([task])
        if client is not None:
            # Closing cancels the channel's RPCs; gRPC reports each cancellation on this loop a
            # moment later. Let that happen now rather than after the caller's loop is closed.
            await asyncio.sleep(_CLOSE_DRAIN)

    # -- calls ----------------------------------------------------------------------------------
    async def call(self, aw: Awaitable[_T], timeout: float | None = None) -> _T:
        """Await one etcd call with a deadline (gRPC has its own; this also covers connecting)."""
        async with deadline((timeout or self.timeout) + _CALL_SLACK):
            return await aw

    async def pause(self, client: EtcdClient, delay: float) -> None:
        """Sleep ``delay`` seconds before a retry, but wake up early when the channel reconnects.

        Polls the channel state rather than awaiting ``channel_ready()``: an abandoned
        connectivity watch lives on in gRPC's core and completes after the event loop is gone.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + delay
        channel = client.channel
        was_ready = True
        while True:
            if channel is not None and self.is_current(client) and client.channel is channel:
                try:
                    ready = channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY
                except Exception:  # a closed channel: just sleep
                    ready, channel = False, None
                if ready and not was_ready:
                    return  # etcd is back: retry now
                was_ready = ready
            left = until - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.1))

    async def keepalive_once(self, client: EtcdClient, lease: int, timeout: float | None = None) -> int:
        """Refresh ``lease`` once; return its new TTL (0: the lease is gone).

        ``aetcd``'s ``refresh_lease`` leaves its keepalive stream to the garbage collector, which
        may finish it after the event loop is closed; this one cancels the stream when done.
        """
        timeout = timeout or self.timeout
        await self.call(client.connect(), timeout)
        call = client.leasestub.LeaseKeepAlive(timeout=timeout, metadata=client.metadata)
        try:
            await call.write(etcd_rpc.LeaseKeepAliveRequest(ID=lease))
            reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise RegistryError("etcd closed the lease keepalive stream without an answer")
        return int(reply.TTL)

    async def read_prefixes(self, client: EtcdClient, prefixes: Sequence[str]) -> tuple[int, int, list[list[Any]]]:
        """One consistent read of several prefixes: (revision, cluster_id, kvs per prefix)."""
        await self.call(client.connect())
        ops = []
        for p in prefixes:
            key = p.encode()
            req = etcd_rpc.RangeRequest(key=key, range_end=aetcd.utils.prefix_range_end(key))
            ops.append(etcd_rpc.RequestOp(request_range=req))
        resp = await self.call(
            client.kvstub.Txn(
                etcd_rpc.TxnRequest(compare=[], success=ops, failure=[]),
                timeout=self.timeout,
                metadata=client.metadata,
            )
        )
        kvs = [list(r.response_range.kvs) for r in resp.responses]
        return int(resp.header.revision), int(resp.header.cluster_id), kvs

    async def read_header(self, client: EtcdClient, prefix: str) -> tuple[int, int]:
        """(revision, cluster_id) from a count-only read: cheap proof that history continues."""
        await self.call(client.connect())
        key = prefix.encode()
        resp = await self.call(
            client.kvstub.Range(
                etcd_rpc.RangeRequest(key=key, range_end=aetcd.utils.prefix_range_end(key), count_only=True),
                timeout=self.timeout,
                metadata=client.metadata,
            )
        )
        return int(resp.header.revision), int(resp.header.cluster_id)

    async def oneshot(self, what: str, fn: Callable[[EtcdClient], Awaitable[_T]]) -> _T:
        """``fn(client)`` on each endpoint in turn until one answers; RegistryUnavailableError
        naming every endpoint and its error when none does."""
        errors: list[str] = []
        attempts, reauthenticated = len(self.endpoints), False
        while len(errors) < attempts:
            client = self.client()
            try:
                return await fn(client)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                errors.append(f"{client.endpoint}: {describe_error(e)}")
                self.failed(client, e)
                if is_auth_error(e) and not reauthenticated:
                    attempts, reauthenticated = attempts + 1, True  # an expired token: once more
        raise RegistryUnavailableError(
            f"cannot {what} ({'; '.join(errors)}). Check the registry address "
            "(etcd://HOST:PORT[,HOST:PORT]) and that etcd is running and reachable."
        )
