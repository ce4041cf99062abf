"""The ``kubernetes`` backend against a stand-in for the Kubernetes API server.

No API server can run here, so :class:`FakeApiServer` stands in for it: a small HTTP server on
127.0.0.1 that serves exactly the Deployment ``scale`` subresource
(``GET``/``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``) with the JSON shapes the
real API server uses (an ``autoscaling/v1`` ``Scale``; a ``v1`` ``Status`` for errors), and records
every request so the tests can check that the backend touches nothing else. The official
``kubernetes`` client talks to it through a ``Configuration`` with ``host=http://127.0.0.1:PORT``
(or a kubeconfig file that points there).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill.autoscale import Controller, ControllerConfig, KubernetesBackend, PolicyConfig
from distill.autoscale.cli import main
from distill.autoscale.errors import BackendError, BackendUnavailableError
from tests.etcd_fixtures import arun, unique_service

_SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")


class FakeApiServer:
    """Stands in for the Kubernetes API server's Deployment scale endpoints; see the module doc."""

    def __init__(self, deployments: dict[tuple[str, str], int], *, forbidden: set[str] | None = None) -> None:
        self.replicas = dict(deployments)
        self.forbidden = forbidden or set()
        self.requests: list[dict[str, Any]] = []
        self.delay = 0.0
        self.version = 100
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.requests.append({
                    "method": method, "path": self.path, "content_type": self.headers.get("Content-Type"),
                    "authorization": self.headers.get("Authorization"), "body": raw.decode() or None,
                })  # fmt: skip
                if fake.delay:
                    time.sleep(fake.delay)
                m = _SCALE.match(self.path.split("?")[0])
                if m is None:
                    return self._send(404, fake.status(404, "NotFound", f"the server could not find {self.path}"))
                ns, name = m.groups()
                if name in fake.forbidden:
                    user = f"system:serviceaccount:{ns}:distill-autoscaler"
                    msg = (f'deployments.apps "{name}" is forbidden: User "{user}" cannot {method.lower()} '
                           'resource "deployments/scale" in API group "apps"')  # fmt: skip
                    return self._send(403, fake.status(403, "Forbidden", msg, name))
                if (ns, name) not in fake.replicas:
                    return self._send(404, fake.status(404, "NotFound", f'deployments.apps "{name}" not found', name))
                if method == "PATCH":
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        return self._send(415, fake.status(415, "UnsupportedMediaType", "unsupported patch type"))
                    patch = json.loads(raw)
                    replicas = patch.get("spec", {}).get("replicas")
                    if not isinstance(replicas, int) or replicas < 0 or set(patch) != {"spec"}:
                        return self._send(422, fake.status(422, "Invalid", f"bad scale patch {patch}", name))
                    fake.replicas[(ns, name)] = replicas
                    fake.version += 1
                return self._send(200, fake.scale(ns, name))

            def do_GET(self) -> None:
                self._handle("GET")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="fake-apiserver"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def scale(self, ns: str, name: str) -> dict[str, Any]:
        n = self.replicas[(ns, name)]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": name, "namespace": ns, "uid": "4f0c3a47-1b5e-4c8e-9a53-0d7b2f1e9c11",
                "resourceVersion": str(self.version), "creationTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": {"replicas": n},
            "status": {"replicas": n, "selector": f"app.kubernetes.io/name={name}"},
        }  # fmt: skip

    @staticmethod
    def status(code: int, reason: str, message: str, name: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        }  # fmt: skip
        if name is not None:
            body["details"] = {"name": name, "group": "apps", "kind": "deployments"}
        return body

    def start(self) -> FakeApiServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def configuration(self, token: str = "test-token") -> k8s_client.Configuration:
        cfg = k8s_client.Configuration(host=self.url)
        cfg.api_key = {"BearerToken": token}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        return cfg


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer({("distill", "cifar-teacher"): 1}, forbidden={"secret-teacher"}).start()
    try:
        yield server
    finally:
        server.close()


def backend(api: FakeApiServer, name: str = "cifar-teacher", **kw: Any) -> KubernetesBackend:
    return KubernetesBackend(name, "distill", configuration=api.configuration(), **kw)


def test_reads_and_patches_only_the_scale_subresource(api: FakeApiServer) -> None:
    async def go() -> None:
        b = backend(api)
        async with b:
            state = await b.observe({})
            assert (state.current, state.managed) == (1, None)
            assert len(state.starting) == 1  # one replica, no teacher registered yet: starting
            await b.scale(3, {})
            assert api.replicas[("distill", "cifar-teacher")] == 3
            assert (await b.observe({})).current == 3

    arun(go(), timeout=30)
    paths = {r["path"].split("?")[0] for r in api.requests}
    assert paths == {"/apis/apps/v1/namespaces/distill/deployments/cifar-teacher/scale"}
    assert {r["method"] for r in api.requests} == {"GET", "PATCH"}
    patch = next(r for r in api.requests if r["method"] == "PATCH")
    assert patch["content_type"] == "application/merge-patch+json"
    assert json.loads(patch["body"]) == {"spec": {"replicas": 3}}
    assert all(r["authorization"] == "Bearer test-token" for r in api.requests)


def test_starting_replicas_count_from_the_registry(api: FakeApiServer) -> None:
    class Entry:
        load = None

    async def go() -> None:
        async with backend(api) as b:
            await b.scale(3, {})
            state = await b.observe({"pod-a": Entry()})
            assert state.current == 3 and len(state.starting) == 2
            assert len(set(state.starting)) == 1  # the time the deficit appeared
            state = await b.observe({"pod-a": Entry(), "pod-b": Entry(), "pod-c": Entry()})
            assert state.starting == ()

    arun(go(), timeout=30)


def test_missing_deployment_fails_at_start_with_a_clear_error(api: FakeApiServer) -> None:
    with pytest.raises(BackendError, match=r'deployment distill/nope not found \(deployments.apps "nope" not found\)'):
        arun(backend(api, "nope").start(), timeout=30)


def test_forbidden_says_which_permission_is_missing(api: FakeApiServer) -> None:
    with pytest.raises(BackendError, match=r"needs get and patch on deployments/scale for 'secret-teacher'"):
        arun(backend(api, "secret-teacher").start(), timeout=30)


def test_unreachable_or_slow_api_is_a_transient_error(api: FakeApiServer) -> None:
    async def go() -> None:
        async with backend(api, timeout=0.5) as b:
            api.delay = 2.0
            start = time.monotonic()
            with pytest.raises(BackendUnavailableError, match=r"no answer|timed out"):
                await b.observe({})
            assert time.monotonic() - start < 3.0
            api.delay = 0.0
            api.close()
            with pytest.raises(BackendUnavailableError):
                await b.scale(2, {})

    arun(go(), timeout=30)


def test_api_server_down_at_start_is_a_clear_error() -> None:
    cfg = k8s_client.Configuration(host="http://127.0.0.1:1")
    with pytest.raises(BackendError, match="Check --kubeconfig"):
        arun(KubernetesBackend("x", "default", configuration=cfg, timeout=1.0).start(), timeout=30)


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {server}\n"
        "users:\n- name: tester\n  user:\n    token: kubeconfig-token\n"
        "contexts:\n- name: test\n  context:\n    cluster: fake\n    user: tester\n    namespace: distill\n"
    )
    return path


def test_kubeconfig_file_is_used(api: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "config", api.url)

    async def go() -> None:
        async with KubernetesBackend("cifar-teacher", "distill", kubeconfig=kubeconfig) as b:
            assert (await b.observe({})).current == 1

    arun(go(), timeout=30)
    assert api.requests and all(r["authorization"] == "Bearer kubeconfig-token" for r in api.requests)


def test_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="cannot load the Kubernetes configuration"):
        arun(KubernetesBackend("x", "default", kubeconfig=tmp_path / "missing").start(), timeout=30)


def test_controller_drives_the_deployment_through_the_registry(api: FakeApiServer) -> None:
    """The whole chain: etcd (no students yet), the policy's minimum, a PATCH to the stand-in."""
    service = unique_service("k8s")
    with LocalEtcd() as etcd:

        async def go() -> None:
            registry = open_registry(etcd.address, timeout=1.0)
            config = ControllerConfig(service, period=0.2, election_ttl=2)
            ctl = Controller(registry, backend(api), PolicyConfig(min_teachers=2, max_teachers=4), config)
            try:
                async with ctl:
                    deadline = time.monotonic() + 15
                    while api.replicas[("distill", "cifar-teacher")] != 2:
                        assert time.monotonic() < deadline, [d.reason for d in ctl.decisions]
                        await asyncio.sleep(0.05)
                    assert ctl.decisions[-1].desired == 2
            finally:
                await registry.close()

        arun(go(), timeout=40)


def test_cli_exits_2_when_the_deployment_does_not_exist(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "config", api.url)
    code = main(["--registry", "etcd://127.0.0.1:1", "--service", "s", "--backend", "kubernetes",
                 "--deployment", "missing", "--namespace", "distill", "--kubeconfig", str(kubeconfig)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "distill-autoscaler: error: deployment distill/missing not found" in err
    assert "kubectl apply -k deploy/" in err
