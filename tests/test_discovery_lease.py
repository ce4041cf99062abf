"""LeaseSession against a real etcd: grant, keepalive past the TTL, loss noticed when another
client revokes the lease, revoke on exit, adoption of a surviving lease, and a partition that makes
the session unreachable (and, past the TTL, no longer certainly alive) without losing the lease."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from discovery import EtcdRegistry
from discovery.aio import bounded
from discovery.etcd import LeaseLostError, LeaseSession
from discovery.local_etcd import LocalEtcd
from tests.etcd_fixtures import TcpProxy, arun, raw_client, unique_service

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


async def until(what: str, check: Callable[[], object], timeout: float) -> None:
    """Wait (bounded) until ``check()`` is true."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.05)


async def lease_ttl(etcd: LocalEtcd, lease_id: int) -> int:
    """The TTL etcd reports for ``lease_id`` now (-1: no such lease)."""
    async with raw_client(etcd) as raw:
        info = await raw.get_lease_info(lease_id)
    return int(info.TTL)


def test_grant_put_and_revoke_on_exit(etcd: LocalEtcd) -> None:
    key = f"/test/{unique_service('lease')}/k"

    async def main() -> None:
        async with EtcdRegistry(etcd.endpoint, timeout=2.0) as reg:
            async with reg.session(ttl=5, name="test") as session:
                assert isinstance(session, LeaseSession)
                lease = session.lease_id
                assert lease is not None and session.ttl == 5
                assert session.reachable and session.alive and not session.lost
                await session.put(key, b"v")
                await session.put_all([(key + "2", b"w")])
                async with raw_client(etcd) as raw:
                    got = await raw.get(key.encode())
                    assert got is not None and got.lease == lease and got.value == b"v"
                    got2 = await raw.get((key + "2").encode())
                    assert got2 is not None and got2.lease == lease
                assert 0 < await lease_ttl(etcd, lease) <= 5
            # Leaving the block revoked the lease: its keys are gone now, not after the TTL.
            assert not session.alive
            await bounded(session.wait_lost(), 5)  # a closed session is done, like Go's Done()
            assert await lease_ttl(etcd, lease) == -1
            async with raw_client(etcd) as raw:
                assert await raw.get(key.encode()) is None
                assert await raw.get((key + "2").encode()) is None
            assert await session.close() is False  # idempotent: nothing left to revoke

    arun(main())


def test_keepalive_holds_the_lease_well_past_its_ttl(etcd: LocalEtcd) -> None:
    key = f"/test/{unique_service('lease')}/k"
    ttl = 2

    async def main() -> None:
        async with EtcdRegistry(etcd.endpoint, timeout=2.0) as reg, reg.session(ttl=ttl) as session:
            await session.put(key, b"v")
            granted_at = time.monotonic()
            # Twice the TTL later, and after several refreshes, the lease and its key still live.
            await until(
                "two TTLs and four refreshes",
                lambda: session.refreshes >= 4 and time.monotonic() - granted_at > 2 * ttl,
                30,
            )
            assert session.alive and session.reachable
            assert session.lease_id is not None and await lease_ttl(etcd, session.lease_id) > 0
            async with raw_client(etcd) as raw:
                got = await raw.get(key.encode())
                assert got is not None and got.lease == session.lease_id

    arun(main())


def test_loss_is_noticed_when_another_client_revokes_the_lease(etcd: LocalEtcd) -> None:
    key = f"/test/{unique_service('lease')}/k"

    async def main() -> None:
        async with EtcdRegistry(etcd.endpoint, timeout=2.0) as reg:
            session = await reg.session(ttl=3).open()
            try:
                await session.put(key, b"v")
                lease = session.lease_id
                assert lease is not None
                async with raw_client(etcd) as raw:
                    await raw.revoke_lease(lease)  # an operator, or an expiry during a long pause
                await bounded(session.wait_lost(), 10)  # the next refresh (within ttl/3) tells
                assert session.lost and not session.alive and not session.reachable
                with pytest.raises(LeaseLostError):
                    await session.put(key, b"again")
                with pytest.raises(LeaseLostError):
                    await session.refresh()
            finally:
                assert await session.close() is False  # nothing to revoke: it is gone

    arun(main())


def test_adopting_a_lease_resumes_it_and_a_gone_one_is_refused(etcd: LocalEtcd) -> None:
    key = f"/test/{unique_service('lease')}/k"

    async def main() -> None:
        async with EtcdRegistry(etcd.endpoint, timeout=2.0) as reg:
            first = await reg.session(ttl=5).open()
            await first.put(key, b"v")
            lease = first.lease_id
            assert lease is not None
            await first.orphan()  # stop refreshing without revoking: the lease lives on
            assert await lease_ttl(etcd, lease) > 0

            async with reg.session(ttl=5, lease_id=lease) as adopted:
                assert adopted.lease_id == lease and adopted.alive
                refreshed = adopted.refreshes
                await until("the adopted lease is refreshed", lambda: adopted.refreshes > refreshed, 10)
                async with raw_client(etcd) as raw:
                    got = await raw.get(key.encode())
                    assert got is not None and got.lease == lease
            assert await lease_ttl(etcd, lease) == -1  # the adopter revoked it on exit

            with pytest.raises(LeaseLostError):
                await reg.session(ttl=5, lease_id=lease).open()

    arun(main())


def test_a_partition_makes_the_session_unreachable_then_it_resumes_the_same_lease(etcd: LocalEtcd) -> None:
    key = f"/test/{unique_service('lease')}/k"

    async def main() -> None:
        proxy = await TcpProxy(etcd.client_port).start()
        try:
            async with (
                EtcdRegistry(proxy.endpoint, timeout=1.0, retry_max_backoff=0.5) as reg,
                EtcdRegistry(etcd.endpoint, timeout=1.0) as direct,
            ):
                session = await reg.session(ttl=2).open()
                try:
                    await session.put(key, b"v")
                    lease = session.lease_id
                    assert lease is not None
                    # Someone on the other side of the cut keeps the lease alive on the server (as
                    # etcd does across its own restarts)...
                    helper = await direct.session(ttl=2, lease_id=lease).open()
                    try:
                        await proxy.cut()
                        await until("the session notices the partition", lambda: not session.reachable, 15)
                        assert session.failure is not None and not session.lost
                        # ...but past its TTL without a refresh of its own, the cut-off session
                        # can no longer vouch for it.
                        await until("validity runs out", lambda: not session.alive, 15)
                        assert not session.lost
                        await proxy.resume()
                        await until("reachable again", lambda: session.reachable, 15)
                        assert session.lease_id == lease and not session.lost
                        await until("alive again", lambda: session.alive, 15)
                    finally:
                        await helper.orphan()  # hand the lease back without revoking it
                    async with raw_client(etcd) as raw:
                        got = await raw.get(key.encode())
                        assert got is not None and got.lease == lease
                finally:
                    assert await session.close() is True
        finally:
            await proxy.close()

    arun(main(), timeout=60)


def test_a_session_opens_once_and_checks_its_ttl() -> None:
    async def main() -> None:
        async with EtcdRegistry("127.0.0.1:1", timeout=0.5) as reg:
            with pytest.raises(ValueError, match="positive"):
                reg.session(ttl=0)
            closed = reg.session(ttl=5)
            assert await closed.close() is False  # never opened: nothing to revoke
            with pytest.raises(Exception, match="opens once"):
                await closed.open()

    arun(main())
