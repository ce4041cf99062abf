"""The ``kubernetes`` backend against a stand-in for the Kubernetes API server.

No API server can run here, so :class:`tests.k8s_apiserver.FakeApiServer` stands in for it (its
docstring lists what it models: resourceVersion conflicts, per-verb RBAC and access reviews, pods
that stay Pending, 429 with Retry-After, other writers). The official ``kubernetes`` client talks to
it through a ``Configuration`` with ``host=http://127.0.0.1:PORT`` (or a kubeconfig file pointing
there). Each behaviour of the stand-in has a test here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s_client

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill.autoscale import Controller, ControllerConfig, KubernetesBackend, PolicyConfig
from distill.autoscale.backends.kubernetes import BackendConflictError
from distill.autoscale.cli import main
from distill.autoscale.errors import BackendError, BackendUnavailableError
from distill.autoscale.policy import PolicyState, ScaleSnapshot, decide
from tests.etcd_fixtures import arun, unique_service
from tests.k8s_apiserver import SSAR_PATH, FakeApiServer

ROOT = Path(__file__).resolve().parent.parent
NS, NAME = "distill", "cifar-teacher"
KEY = (NS, NAME)


class FakeClock:
    """A monotonic clock the test moves by hand (Retry-After waits, start timeouts, hold windows)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RunningClock:
    """The monotonic clock plus a jump the test makes (``clock.now += 30`` ends a 30 s window at once)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    @property
    def now(self) -> float:
        return self()

    @now.setter
    def now(self, value: float) -> None:
        self.offset += value - self()


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
    async def go() -> str:
        b = backend(api)
        async with b:
            state = await b.observe({})
            assert (state.current, state.managed) == (1, None)
            assert len(state.starting) == 1  # one replica, no teacher registered yet: starting
            version = str(api.versions[KEY])
            await b.scale(3, {})
            assert api.replicas[KEY] == 3
            assert (await b.observe({})).current == 3
        return version

    version = arun(go(), timeout=30)
    scale = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}/scale"
    assert {r["path"].split("?")[0] for r in api.requests} == {scale, SSAR_PATH}
    assert {(r["method"], r["path"].split("?")[0]) for r in api.requests} == {
        ("POST", SSAR_PATH), ("GET", scale), ("PATCH", scale)
    }
    (patch,) = api.writes()
    assert patch["content_type"] == "application/merge-patch+json"
    # The write carries the resourceVersion of the read the decision was taken on, and our name.
    assert json.loads(patch["body"]) == {"metadata": {"resourceVersion": version}, "spec": {"replicas": 3}}
    assert patch["query"]["fieldManager"] == KubernetesBackend.FIELD_MANAGER
    assert all(r["authorization"] == "Bearer test-token" for r in api.requests)


def test_starting_replicas_count_from_the_registry(api: FakeApiServer) -> None:
    class Entry:
        load = None

    async def go() -> None:
        async with backend(api, clock=clock) as b:
            await b.scale(3, {})
            state = await b.observe({"pod-a": Entry()})
            assert state.current == 3 and state.starting == (1000.0, 1000.0)  # when the gap appeared
            clock.now += 50
            await b.scale(4, {})
            state = await b.observe({"pod-a": Entry()})
            assert state.starting == (1000.0, 1000.0, 1050.0)  # one start time per missing replica
            state = await b.observe({"pod-a": Entry(), "pod-b": Entry()})
            assert state.starting == (1000.0, 1000.0)  # the newest go first: old gaps keep their age
            state = await b.observe({f"pod-{c}": Entry() for c in "abcd"})
            assert state.starting == ()

    clock = FakeClock()
    arun(go(), timeout=30)


def test_pending_pods_count_as_starting_not_as_capacity(api: FakeApiServer) -> None:
    """spec.replicas 3 with 2 pods Pending (no GPU free): 1 ready teacher is the capacity; the 2
    hold further scale-ups while young and show as late after --start-timeout."""
    policy = PolicyConfig(min_teachers=1, max_teachers=8, start_timeout=120, settle=0)
    loaded = SimpleNamespace(load=SimpleNamespace(capacity_samples_per_s=100.0, busy_fraction=1.0, queue_depth=4,
                                                  in_flight=8, samples_per_s=100.0, draining=False))  # fmt: skip
    students = [SimpleNamespace(student_id=f"s{i}", samples_per_s=100.0, wait_fraction=0.5) for i in range(3)]

    async def go() -> None:
        async with backend(api, clock=clock) as b:
            api.pending[KEY] = 2
            api.set_replicas(NS, NAME, 3)
            view = api.registry_view(NS, NAME)
            assert len(view) == 1
            teachers = {k: loaded for k in view}
            state = await b.observe(view)
            assert (state.current, len(state.starting)) == (3, 2)
            assert "2 not registered" in state.detail
            snap = ScaleSnapshot.from_registry(state.current, teachers, students, starting=state.starting)
            d = decide(snap, policy, PolicyState(), clock())
            assert d.figures["ready"] == 1 and d.figures["starting"] == 2
            assert (d.action, d.cause) == ("hold", "starting"), d.reason
            clock.now += 121
            state = await b.observe(api.registry_view(NS, NAME))
            snap = ScaleSnapshot.from_registry(state.current, teachers, students, starting=state.starting)
            d = decide(snap, policy, d.new_state, clock())
            assert d.figures["ready"] == 1 and d.figures["starting"] == 0
            assert "2 not ready after 120 s" in d.reason

    clock = FakeClock()
    arun(go(), timeout=30)


def test_a_stale_write_gets_409_and_is_decided_again(api: FakeApiServer) -> None:
    """kubectl scale lands between our read and our write: the write is refused, nothing is
    retried blindly, and the error names the other writer."""

    async def go() -> None:
        async with backend(api) as b:
            await b.observe({})
            api.set_replicas(NS, NAME, 5, manager="kubectl")
            with pytest.raises(BackendConflictError, match=r"resized to 5 by 'kubectl'.*nothing written"):
                await b.scale(3, {})
            assert api.replicas[KEY] == 5
            state = await b.observe({})
            assert state.current == 5 and "spec.replicas last set by 'kubectl'" in state.detail

    arun(go(), timeout=30)
    assert len(api.writes()) == 1


def test_a_status_update_between_read_and_write_only_costs_a_retry(api: FakeApiServer) -> None:
    async def go() -> tuple[str, str]:
        async with backend(api) as b:
            await b.observe({})
            old = str(api.versions[KEY])
            api.status_update(NS, NAME)
            new = str(api.versions[KEY])
            await b.scale(3, {})
            return old, new

    old, new = arun(go(), timeout=30)
    assert api.replicas[KEY] == 3
    sent = [json.loads(w["body"])["metadata"]["resourceVersion"] for w in api.writes()]
    assert sent == [old, new]


def test_back_to_back_writes_use_the_version_the_last_write_returned(api: FakeApiServer) -> None:
    async def go() -> None:
        async with backend(api) as b:
            await b.scale(3, {})
            await b.scale(2, {})  # no read in between: the first write's answer carries the version

    arun(go(), timeout=30)
    assert api.replicas[KEY] == 2
    assert len(api.writes()) == 2  # no 409 and retry


def test_unconditional_writes_would_be_accepted(api: FakeApiServer) -> None:
    """The stand-in's 409 comes from the resourceVersion in the body, as on a real API server: a
    patch without one is applied (so the conflict tests above test the backend, not the stand-in)."""

    async def go() -> None:
        async with backend(api) as b:
            await b.observe({})
            api.set_replicas(NS, NAME, 5)
            await asyncio.to_thread(
                b._api.patch_namespaced_deployment_scale, NAME, NS, {"spec": {"replicas": 2}},
                _content_type="application/merge-patch+json",
            )  # fmt: skip

    arun(go(), timeout=30)
    assert api.replicas[KEY] == 2


def test_too_many_requests_waits_for_retry_after(api: FakeApiServer) -> None:
    async def go() -> None:
        async with backend(api, clock=clock) as b:
            api.throttle.append(30)
            with pytest.raises(BackendUnavailableError, match=r"429 Too Many Requests.*waiting 30 s"):
                await b.observe({})
            sent = len(api.requests)
            for call in (b.observe({}), b.scale(3, {})):
                with pytest.raises(BackendUnavailableError, match=r"for another 30.0 s.*Retry-After"):
                    await call
            assert len(api.requests) == sent, "a request went out before Retry-After passed"
            clock.now += 30
            await b.scale(3, {})
            assert api.replicas[KEY] == 3
            api.throttle.append(None)  # no header: wait a second
            with pytest.raises(BackendUnavailableError, match=r"waiting 1 s"):
                await b.observe({})
            api.throttle.append(10**6)  # absurd: capped
            clock.now += 1
            with pytest.raises(BackendUnavailableError, match=rf"waiting {KubernetesBackend.MAX_RETRY_AFTER:g} s"):
                await b.observe({})

    clock = FakeClock()
    arun(go(), timeout=30)


def test_missing_deployment_fails_at_start_with_a_clear_error(api: FakeApiServer) -> None:
    with pytest.raises(BackendError, match=r'deployment distill/nope not found \(deployments.apps "nope" not found\)'):
        arun(backend(api, "nope").start(), timeout=30)


def test_forbidden_says_which_permission_is_missing(api: FakeApiServer) -> None:
    with pytest.raises(BackendError, match=r"needs get and patch on deployments/scale for 'secret-teacher'.*"
                                           r"missing verbs: get, patch"):  # fmt: skip
        arun(backend(api, "secret-teacher").start(), timeout=30)


def test_a_role_without_patch_fails_at_start_naming_patch(api: FakeApiServer) -> None:
    api.verbs[NAME] = {"get"}
    with pytest.raises(BackendError, match=r"not allowed to patch deployments/scale .*missing verb: patch \("):
        arun(backend(api).start(), timeout=30)
    assert api.writes() == []  # found out by asking, not by trying
    reviewed = [json.loads(r["body"])["spec"]["resourceAttributes"] for r in api.requests if r["method"] == "POST"]
    assert [(a["verb"], a["resource"], a["subresource"], a["name"]) for a in reviewed] == [
        ("get", "deployments", "scale", NAME), ("patch", "deployments", "scale", NAME)
    ]


def test_the_stand_in_enforces_each_verb(api: FakeApiServer, caplog: pytest.LogCaptureFixture) -> None:
    """Without access reviews (an API server that lacks them) start checks get by reading; a missing
    patch shows at the first write, with the same message."""
    api.verbs[NAME] = {"get"}
    api.ssar = False

    async def go() -> None:
        async with backend(api) as b:
            assert (await b.observe({})).current == 1
            with pytest.raises(BackendError, match=r"not allowed to patch .*HTTP 403.*missing verb: patch "):
                await b.scale(2, {})

    with caplog.at_level(logging.WARNING, logger="distill.autoscale.kubernetes"):
        arun(go(), timeout=30)
    assert api.replicas[KEY] == 1
    assert any("'patch' on deployments/scale will be checked at the first scale" in r.getMessage()
               for r in caplog.records)


def test_the_role_grants_exactly_the_verbs_the_backend_checks() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "autoscaler-role.yaml").read_text()))
    (rule,) = docs[0]["rules"]
    assert rule["resources"] == ["deployments/scale"]
    assert sorted(rule["verbs"]) == sorted(KubernetesBackend.VERBS)


def test_unreachable_or_slow_api_is_a_transient_error(api: FakeApiServer) -> None:
    async def go() -> None:
        async with backend(api, timeout=0.5) as b:
            api.delay = 2.0
            with pytest.raises(BackendUnavailableError, match=r"no answer|timed out"):
                await b.observe({})
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


def test_another_writer_is_not_fought_for_the_down_window(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """kubectl scale --replicas=1 under a --min 2 controller: the controller notices, says so once
    naming kubectl, counts it, holds 1 for the down window (no write at all), then acts again."""
    service = unique_service("k8s-ext")
    clock = RunningClock()
    with LocalEtcd() as etcd:

        async def wait_for(what: str, ok: Any, ctl: Controller) -> None:
            deadline = time.monotonic() + 15
            while not ok():
                assert time.monotonic() < deadline, (what, [d.reason for d in list(ctl.decisions)[-5:]])
                await asyncio.sleep(0.02)

        async def go() -> None:
            registry = open_registry(etcd.address, timeout=1.0)
            config = ControllerConfig(service, period=0.05, election_ttl=2)
            policy = PolicyConfig(min_teachers=2, max_teachers=4, down_window=30)
            ctl = Controller(registry, backend(api), policy, config, clock=clock)
            try:
                async with ctl:
                    await wait_for("scaled to --min", lambda: api.replicas[KEY] == 2, ctl)
                    writes = len(api.writes())
                    api.set_replicas(NS, NAME, 1, manager="kubectl")
                    await wait_for("noticed", lambda: ctl.metrics.external_changes == 1, ctl)
                    seen = len(ctl.decisions)
                    await wait_for("held for 20 periods", lambda: len(ctl.decisions) >= seen + 20, ctl)
                    assert api.replicas[KEY] == 1 and len(api.writes()) == writes, "it fought the other writer"
                    held = list(ctl.decisions)[seen:]
                    assert all((d.action, d.cause, d.desired) == ("hold", "external", 1) for d in held)
                    assert "scale up 1 -> 2" in held[-1].reason  # what it would do, and will, later
                    assert b"distill_autoscaler_external_hold" in ctl.metrics.render()
                    assert ctl.metrics.registry.get_sample_value(
                        "distill_autoscaler_external_hold", {"service": service}
                    ) == 1
                    clock.now += 30
                    await wait_for("acts again after the window", lambda: api.replicas[KEY] == 2, ctl)
                    assert ctl.metrics.external_changes == 1  # its own write is not another writer
            finally:
                await registry.close()

        with caplog.at_level(logging.WARNING, logger="distill.autoscale"):
            arun(go(), timeout=60)
    notices = [r.getMessage() for r in caplog.records if "another writer" in r.getMessage()]
    assert len(notices) == 1, notices
    assert "changed the teacher count to 1" in notices[0] and "'kubectl'" in notices[0]
    assert "30 s down window" in notices[0]


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
