"""components/etcd-tls, rendered: etcd serves TLS only and wants client certificates, every process
that talks to etcd gets the certificate, the user and the password (its flags parsed by its own
parser), cert-manager's certificates cover the names clients dial; and the setup Job's script, run
with the real etcdctl against a real etcd started with the component's own TLS flags, turns on
authentication such that the teacher's rendered flags register and a key outside /distill/v1/ is
refused."""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from discovery import EtcdRegistry
from discovery.etcd_binary import find_etcdctl
from discovery.local_etcd import LocalEtcd
from discovery.options import PASSWORD_ENV
from distill.autoscale.cli import build_parser as autoscaler_parser
from distill.autoscale.cli import registry_options
from distill.flags import add_distill_args, distill_options_from_args
from teacher_server.cli import build_parser as teacher_parser
from teacher_server.cli import serve_options
from tests.certs import make_certs
from tests.etcd_fixtures import arun, ids, next_matching, record
from tests.test_deploy_llm import gateway_args
from tests.test_deploy_render import container, containers, find, flag, pod_spec, variant

Doc = dict[str, Any]
CLIENT_DIR = "/etc/distill/etcd"
SERVER_DIR = "/etc/etcd/tls/server"


def registry_clients(objs: list[Doc]) -> Iterator[tuple[Doc, Doc, argparse.Namespace]]:
    """(object, container, parsed flags) of every container that talks to etcd, each parsed by its
    own command's parser."""
    for obj in objs:
        for c in containers(obj):
            argv = c.get("args", [])
            if c.get("command") == ["teacher-server"]:
                yield obj, c, teacher_parser().parse_args(argv)
            elif c.get("command") == ["distill-autoscaler"]:
                yield obj, c, autoscaler_parser().parse_args(argv)
            elif c.get("command") == ["distill"]:
                yield obj, c, gateway_args(argv)
            elif c.get("command") == ["torchrun"]:
                parser = argparse.ArgumentParser()
                add_distill_args(parser)
                parser.add_argument("--steps", type=int)
                yield obj, c, parser.parse_args(argv[argv.index("/opt/student/train_student.py") + 1 :])


def _security(args: argparse.Namespace) -> tuple[str | None, ...]:
    prefix = "distill_registry_" if hasattr(args, "distill_registry") else "registry_"
    return tuple(getattr(args, prefix + k) for k in ("ca_cert", "cert", "key", "user"))


def test_etcd_serves_tls_only_and_wants_client_certificates() -> None:
    sts = find(variant("llm+etcd-tls"), "StatefulSet", "etcd")
    c = container(sts, "etcd")
    command = c["command"]
    assert "--client-cert-auth" in command and "--peer-client-cert-auth" in command
    for name in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                 "--initial-advertise-peer-urls"):  # fmt: skip
        assert flag(c, name).startswith("https://"), name
    assert flag(c, "--initial-cluster").count("=https://") == 3 and "http://" not in flag(c, "--initial-cluster")
    metrics = flag(c, "--listen-metrics-urls")
    assert metrics.startswith("http://")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert metrics.endswith(f":{ports['metrics']}")
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "metrics", "the client port wants a certificate a kubelet lacks"
    assert flag(c, "--trusted-ca-file").startswith(SERVER_DIR) and flag(c, "--peer-trusted-ca-file")


@pytest.mark.parametrize("name", ["llm+etcd-tls", "llm+gateway+etcd-tls+monitoring", "base+etcd-tls"])
def test_every_registry_client_has_the_certificate_the_user_and_the_password(name: str) -> None:
    objs = variant(name)
    seen = set()
    for obj, c, args in registry_clients(objs):
        where = f"{name}: {obj['metadata']['name']}/{c['name']}"
        assert _security(args) == (f"{CLIENT_DIR}/ca.crt", f"{CLIENT_DIR}/tls.crt", f"{CLIENT_DIR}/tls.key",
                                   "distill"), where
        password = [e for e in c["env"] if e["name"] == PASSWORD_ENV]
        assert password == [{"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
            "name": "etcd-auth", "key": "distill-password"}}}], where  # fmt: skip
        seen.add(obj["metadata"]["name"])
    expected = {"cifar-teacher", "distill-autoscaler", "student"}
    if name != "base+etcd-tls":
        expected |= {"llm-teacher", "llm-autoscaler"}
    if "gateway" in name:
        expected.add("llm-student")
    assert seen == expected
    # the trainer itself never talks to etcd: only its gateway does
    if "gateway" in name:
        trainer = container(find(objs, "Job", "llm-student"), "trainer")
        assert "etcd" not in str(trainer)


def _covers(patterns: list[str], host: str) -> bool:
    return any(p == host or (p.startswith("*.") and "." not in host.split(".", 1)[0] and
                             fnmatch.fnmatchcase(host, p) and host.count(".") == p.count(".")) for p in patterns)


def test_cert_manager_issues_every_secret_etcd_tls_mounts_for_the_names_clients_dial() -> None:
    objs = variant("all+cert-manager")
    certs = {o["spec"]["secretName"]: o for o in objs if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Issuer"}
    for cert in certs.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers
    for issuer in issuers.values():
        if "ca" in issuer["spec"]:
            assert certs[issuer["spec"]["ca"]["secretName"]]["spec"]["isCA"] is True
    mounted = {v["secret"]["secretName"] for o in objs if pod_spec(o) for v in pod_spec(o).get("volumes", [])  # type: ignore[union-attr]
               if "secret" in v}  # fmt: skip
    assert mounted == {"etcd-server-tls", "etcd-peer-tls", "etcd-client-tls"} and mounted <= set(certs)
    hosts = set()
    for _, _, args in registry_clients(objs):
        url = getattr(args, "distill_registry", None) or args.registry
        hosts |= {hp.rsplit(":", 1)[0] for hp in url.removeprefix("etcd://").split(",")}
    assert hosts == {"etcd-0.etcd", "etcd-1.etcd", "etcd-2.etcd"}
    server, peer, client = (certs[s]["spec"] for s in ("etcd-server-tls", "etcd-peer-tls", "etcd-client-tls"))
    assert all(_covers(server["dnsNames"], h) for h in hosts) and not _covers(server["dnsNames"], "etcd-0.evil.com")
    assert all(_covers(peer["dnsNames"], h) for h in hosts)
    assert "server auth" in server["usages"] and {"server auth", "client auth"} <= set(peer["usages"])
    assert client["usages"] == ["client auth"] and client["commonName"] == "distill"


# -- the setup Job against a real etcd --------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Secrets' files as the pods see them, at temporary paths: mount path -> directory."""
    made = make_certs(tmp_path_factory.mktemp("certs"))
    out = {}
    for mount, leaf in ((SERVER_DIR, "server"), (CLIENT_DIR, "client")):
        d = tmp_path_factory.mktemp(leaf)
        shutil.copy(made.ca_pem, d / "ca.crt")
        shutil.copy(getattr(made, f"{leaf}_pem"), d / "tls.crt")
        shutil.copy(getattr(made, f"{leaf}_key"), d / "tls.key")
        out[mount] = d
    return out


def local(value: str, files: dict[str, Path]) -> str:
    for mount, d in files.items():
        value = value.replace(mount, str(d))
    return value


@pytest.fixture(scope="module")
def tls_etcd(tls_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One member with the component's own client-side TLS flags (the cluster flags name hosts
    that exist only in the cluster)."""
    c = container(find(variant("llm+etcd-tls"), "StatefulSet", "etcd"), "etcd")
    flags = [local(a, tls_files) for a in c["command"]
             if a.split("=")[0] in ("--client-cert-auth", "--trusted-ca-file", "--cert-file", "--key-file")]
    assert len(flags) == 4
    with LocalEtcd(tmp_path_factory.mktemp("etcd"), scheme="https", extra_args=flags) as server:
        yield server


def run_setup(etcd: LocalEtcd, files: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    job = find(variant("llm+etcd-tls"), "Job", "etcd-auth-setup")
    c = container(job, "setup")
    env = {"PATH": f"{Path(find_etcdctl()).parent}{os.pathsep}{os.environ['PATH']}"}  # the etcdctl that goes with etcd
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = local(e["value"], files)
    env.update(ETCDCTL_ENDPOINTS=etcd.client_url, ROOT_PASSWORD="root-secret", DISTILL_REGISTRY_PASSWORD="mesh-secret")
    assert {e["name"] for e in c["env"]} <= set(env)
    return subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=60, check=False)


def etcdctl(etcd: LocalEtcd, files: dict[str, Path], user: str, *args: str) -> subprocess.CompletedProcess[str]:
    d = files[CLIENT_DIR]
    argv = [find_etcdctl(), f"--endpoints={etcd.client_url}",
            f"--cacert={d / 'ca.crt'}", f"--cert={d / 'tls.crt'}", f"--key={d / 'tls.key'}", f"--user={user}",
            "--dial-timeout=5s", "--command-timeout=5s", *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.timeout(120)
def test_setup_job_turns_on_auth_and_the_rendered_flags_log_in(
    tls_etcd: LocalEtcd, tls_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run_setup(tls_etcd, tls_files)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "authentication is on" in first.stdout
    again = run_setup(tls_etcd, tls_files)  # a retried or re-applied Job changes nothing
    assert again.returncode == 0 and "already on" in again.stdout, again.stdout + again.stderr

    assert etcdctl(tls_etcd, tls_files, "distill:mesh-secret", "put", "/distill/v1/probe", "1").returncode == 0
    refused = etcdctl(tls_etcd, tls_files, "distill:mesh-secret", "put", "/elsewhere", "1")
    assert refused.returncode != 0 and "permission denied" in refused.stderr
    assert etcdctl(tls_etcd, tls_files, "distill:wrong", "get", "/distill/v1/probe").returncode != 0
    assert etcdctl(tls_etcd, tls_files, "root:root-secret", "user", "list").stdout.split() == ["distill", "root"]

    objs = variant("llm+etcd-tls")
    monkeypatch.setenv(PASSWORD_ENV, "mesh-secret")

    def argv(kind: str, name: str, container_name: str) -> list[str]:
        return [local(a, tls_files) for a in container(find(objs, kind, name), container_name)["args"]]

    teacher = teacher_parser().parse_args(argv("Deployment", "llm-teacher", "teacher"))
    options = serve_options(teacher)["registry_options"]  # the files exist, the password is set
    assert options["username"] == "distill" and options["password"] == "mesh-secret"
    scaler = autoscaler_parser().parse_args(argv("Deployment", "llm-autoscaler", "autoscaler"))
    assert {k: v for k, v in registry_options(scaler).items() if k != "timeout"} == options
    job = argv("Job", "student", "student")
    student = argparse.ArgumentParser()
    add_distill_args(student)
    student.add_argument("--steps", type=int)
    parsed = student.parse_args(job[job.index("/opt/student/train_student.py") + 1 :])
    assert distill_options_from_args(parsed)["registry_options"] == options

    async def main() -> None:
        async with EtcdRegistry(tls_etcd.endpoint, **options) as reg:
            watch = reg.watch(teacher.service)
            async with reg.register(teacher.service, record("llm-teacher-0"), ttl=5) as r:
                assert r.registered
                await next_matching(watch, ids("llm-teacher-0"))

    arun(main())
