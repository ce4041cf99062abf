"""EtcdRegistry against an etcd that requires mutual TLS, and one that requires a password.

The unit tests check that the options reach the client; these check that the client then really
talks to such an etcd (the TLS code path is ours: aetcd 1.0 has none)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery import EtcdRegistry, RegistryUnavailableError
from discovery.local_etcd import LocalEtcd
from tests.certs import make_certs
from tests.etcd_fixtures import arun, enable_root_auth, ids, next_matching, record, unique_service

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs")).dir


@pytest.fixture(scope="module")
def tls_etcd(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    args = [
        "--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server.key"),
        "--client-cert-auth", "--trusted-ca-file", str(certs / "ca.pem"),
    ]  # fmt: skip
    with LocalEtcd(tmp_path_factory.mktemp("tls-etcd"), scheme="https", extra_args=args) as server:
        yield server


def test_mutual_tls_registration_and_watch(tls_etcd: LocalEtcd, certs: Path) -> None:
    svc = unique_service()

    async def main() -> None:
        tls = {"ca_cert": certs / "ca.pem", "cert_key": certs / "client.key", "cert_cert": certs / "client.pem"}
        async with EtcdRegistry(tls_etcd.endpoint, **tls) as reg:
            watch = reg.watch(svc)
            async with reg.register(svc, record("secure"), ttl=5) as r:
                assert r.registered
                await next_matching(watch, ids("secure"))
        # Without a client certificate the server refuses: the student is told, boundedly.
        async with EtcdRegistry(tls_etcd.endpoint, ca_cert=certs / "ca.pem", connect_timeout=1.0) as bad:
            with pytest.raises(RegistryUnavailableError):
                await bad.watch(svc).__anext__()
            async with bad.register(svc, record("intruder"), ttl=5) as intruder:  # never raises: retries
                assert not await intruder.wait_registered(2.0)
        async with EtcdRegistry(tls_etcd.endpoint, **tls) as reg:
            assert "intruder" not in await reg.teachers(svc), "a client without a certificate registered"

    arun(main())


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    # Tokens expire after 1 s idle, so the tests also cover getting a fresh one.
    with LocalEtcd(tmp_path_factory.mktemp("auth-etcd"), extra_args=["--auth-token-ttl", "1"]) as server:
        enable_root_auth(server)
        yield server


def test_password_authentication(auth_etcd: LocalEtcd) -> None:
    svc = unique_service()

    async def main() -> None:
        async with EtcdRegistry(auth_etcd.endpoint, username="root", password="rootpw") as reg:
            watch = reg.watch(svc)
            async with reg.register(svc, record("authed"), ttl=5):
                await next_matching(watch, ids("authed"))
            assert await reg.demand(svc) == []
            await asyncio.sleep(2.5)  # the token expires
            assert await reg.demand(svc) == []
            async with reg.register(svc, record("again"), ttl=5) as r:
                assert r.registered
                await next_matching(watch, ids("again"))
        for creds in ({}, {"username": "root", "password": "wrong"}):
            async with EtcdRegistry(auth_etcd.endpoint, connect_timeout=1.0, **creds) as bad:  # type: ignore[arg-type]
                with pytest.raises(RegistryUnavailableError):
                    await bad.watch(svc).__anext__()
                async with bad.register(svc, record("intruder"), ttl=5) as intruder:  # never raises: retries
                    assert not await intruder.wait_registered(2.0)
        async with EtcdRegistry(auth_etcd.endpoint, username="root", password="rootpw") as reg:
            assert "intruder" not in await reg.teachers(svc), "an unauthenticated client registered"

    arun(main())
