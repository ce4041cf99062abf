"""The LLM pieces of deploy/, rendered: the LLM teacher (its command parsed by teacher-server's own
parser, weights read-only from a ReadOnlyMany claim or an OCI image volume, probes sized for large
weights), its autoscaler, the trainer Job with `distill gateway` as a native sidecar on loopback,
the PodMonitors, the weights kit, and the overlay docs/deploy.md tells users to write."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
import yaml

from distill import cli as distill_cli
from distill.autoscale.cli import build_parser as autoscaler_parser
from distill.gateway_cli import config_from_args
from teacher_server.cli import build_parser as teacher_parser
from teacher_server.cli import config_options
from tests.test_deploy_render import (
    DEPLOY,
    REPO,
    build,
    build_overlay,
    container,
    find,
    pod_spec,
    render,
    validate,
    variant,
)

Doc = dict[str, Any]


def gateway_args(argv: list[str]) -> argparse.Namespace:
    """`distill gateway ARGS` parsed by the real `distill` parser: every flag the manifest passes is
    one the command takes."""
    args = distill_cli.build_parser().parse_args(argv)
    assert args.command == "gateway"
    return args


def test_llm_teacher_command_parses_with_teacher_servers_parser() -> None:
    dep = find(variant("llm"), "Deployment", "llm-teacher")
    c = container(dep, "teacher")
    assert c["command"] == ["teacher-server"]
    args = teacher_parser().parse_args(c["args"])
    config_options(args)  # every flag maps onto serve()'s keywords
    assert args.model == "hf:/models/teacher" and args.compute_dtype == "BF16" and args.device == "cuda:0"
    assert args.max_batch_tokens > 0 and args.service == "llm-teacher"
    assert (args.host, args.advertise) == ("0.0.0.0", f"$(POD_IP):{args.port}")
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert "replicas" not in dep["spec"], "the autoscaler owns replicas"


def test_llm_teacher_probes_wait_for_large_weights_and_never_kill_a_drain() -> None:
    dep = find(variant("llm"), "Deployment", "llm-teacher")
    c = container(dep, "teacher")
    args = teacher_parser().parse_args(c["args"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": args.port}, probe  # the gRPC health service
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800, "30 minutes to load large weights"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + args.drain_grace
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pdb = find(variant("llm"), "PodDisruptionBudget", "llm-teacher")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def _weights(objs: list[Doc]) -> tuple[Doc, Doc]:
    dep = find(objs, "Deployment", "llm-teacher")
    (mount,) = container(dep, "teacher")["volumeMounts"]
    (volume,) = [v for v in pod_spec(dep)["volumes"] if v["name"] == mount["name"]]  # type: ignore[index]
    assert mount["readOnly"] is True
    args = teacher_parser().parse_args(container(dep, "teacher")["args"])
    assert args.model.removeprefix("hf:").startswith(mount["mountPath"] + "/")
    return mount, volume


def test_weights_come_read_only_from_a_read_only_many_claim() -> None:
    objs = variant("llm")
    _, volume = _weights(objs)
    assert volume["persistentVolumeClaim"] == {"claimName": "llm-weights", "readOnly": True}
    claim = find(objs, "PersistentVolumeClaim", "llm-weights")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    restored = find(render("llm-teacher", "llm-weights-from-snapshot"), "PersistentVolumeClaim", "llm-weights")
    snapshot = yaml.safe_load((DEPLOY / "weights" / "snapshot.yaml").read_text())
    assert restored["spec"]["dataSource"] == {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                                              "name": snapshot["metadata"]["name"]}


def test_weights_from_an_oci_image_volume_replace_the_claim() -> None:
    objs = variant("llm+weights-image")
    _, volume = _weights(objs)
    assert set(volume) == {"name", "image"} and volume["image"]["reference"]
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"], "the unused claim is dropped"


def test_llm_autoscaler_scales_only_the_llm_teacher() -> None:
    objs = variant("llm")
    dep = find(objs, "Deployment", "llm-autoscaler")
    args = autoscaler_parser().parse_args(container(dep, "autoscaler")["args"])
    teacher = teacher_parser().parse_args(container(find(objs, "Deployment", "llm-teacher"), "teacher")["args"])
    assert (args.backend, args.deployment, args.service) == ("kubernetes", "llm-teacher", teacher.service)
    assert args.registry == teacher.registry and args.start_timeout >= 600
    assert find(objs, "Role", "llm-autoscaler")["rules"][0]["resourceNames"] == ["llm-teacher"]
    assert pod_spec(dep)["serviceAccountName"] == "llm-autoscaler"  # type: ignore[index]
    # the base's autoscaler still scales only the base's teacher
    base = container(find(objs, "Deployment", "distill-autoscaler"), "autoscaler")
    assert autoscaler_parser().parse_args(base["args"]).deployment == "cifar-teacher"


def test_trainer_job_runs_the_gateway_as_a_native_sidecar_on_loopback() -> None:
    objs = variant("llm+gateway")
    job = find(objs, "Job", "llm-student")
    spec = pod_spec(job)
    assert spec is not None and spec["restartPolicy"] == "Never"
    (gw,) = spec["initContainers"]
    assert gw["restartPolicy"] == "Always", "a native sidecar"
    args = gateway_args(gw["command"][1:] + gw["args"])
    assert gw["command"] == ["distill"] and args.command == "gateway"
    assert args.host == "127.0.0.1"
    config = config_from_args(args)  # the flags go together (no TLS files here: they are the etcd-tls overlay's)
    assert (config.port, config.host, config.registry, config.service) == (
        args.port, "127.0.0.1", args.registry, args.service)
    teacher = teacher_parser().parse_args(container(find(objs, "Deployment", "llm-teacher"), "teacher")["args"])
    assert (args.registry, args.service) == (teacher.registry, teacher.service)
    for probe in ("startupProbe", "livenessProbe"):
        # the kubelet would dial the pod IP, where nothing listens: the probes run inside the container
        assert set(gw[probe]) & {"httpGet", "grpc", "tcpSocket"} == set(), probe
        command = gw[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"] and "127.0.0.1" in command[2] and str(args.port) in command[2]
        compile(command[2], probe, "exec")
    start = gw["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800, "the trainer waits for a first teacher"
    (trainer,) = spec["containers"]
    url = {e["name"]: e.get("value") for e in trainer["env"]}["TEACHER_URL"]
    assert url == f"http://127.0.0.1:{args.port}", "one URL: the gateway on loopback"
    assert "$(TEACHER_URL)" in " ".join(trainer["args"])
    script = find(objs, "ConfigMap", "llm-trainer-script")["data"]["score_prompts.py"]
    compile(script, "score_prompts.py", "exec")
    assert "/v1/completions" in script and "prompt_logprobs" in script


def test_pod_monitors_scrape_every_teacher_and_autoscaler_on_their_metrics_ports() -> None:
    objs = variant("llm+gateway+etcd-tls+monitoring")
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PodMonitor"}
    expected = {"distill-teachers": ({"cifar-teacher", "llm-teacher"}, teacher_parser()),
                "distill-autoscalers": ({"distill-autoscaler", "llm-autoscaler"}, autoscaler_parser())}
    assert set(monitors) == set(expected)
    for name, (deployments, parser) in expected.items():
        spec = monitors[name]["spec"]
        selected = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"
                    and spec["selector"]["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"].items()}
        assert selected == deployments, name
        (endpoint,) = spec["podMetricsEndpoints"]
        for dep in deployments:
            c = pod_spec(find(objs, "Deployment", dep))["containers"][0]  # type: ignore[index]
            port = {p["name"]: p["containerPort"] for p in c["ports"]}[endpoint["port"]]
            assert port == parser.parse_args(c["args"]).metrics_port, dep


def test_weights_kit_builds_validates_and_writes_where_the_teacher_reads() -> None:
    objs = build(DEPLOY / "weights")
    objs += [yaml.safe_load((DEPLOY / "weights" / f).read_text()) for f in ("snapshot.yaml", "loader-pod.yaml")]
    for obj in objs:
        validate(obj)
        assert obj["metadata"].get("namespace", "distill") == "distill"
    job = find(objs, "Job", "llm-weights-copy")
    code = container(job, "copy")["command"][-1]
    compile(code, "copy", "exec")
    staging = find(objs, "PersistentVolumeClaim", "llm-weights-staging")
    assert staging["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert find(objs, "VolumeSnapshot", "llm-weights")["spec"]["source"] == {
        "persistentVolumeClaimName": "llm-weights-staging"}
    (mount,) = container(job, "copy")["volumeMounts"]
    teacher_dir = re.search(r'local_dir = "([^"]+)"', code).group(1)  # type: ignore[union-attr]
    assert teacher_dir == f"{mount['mountPath']}/teacher", "the directory hf:/models/teacher reads after the copy"
    loader = find(objs, "Pod", "llm-weights-loader")
    assert loader["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "llm-weights-staging"


DOCS = (REPO / "docs" / "deploy.md").read_text()


def test_the_overlay_in_the_docs_builds_and_validates() -> None:
    m = re.search(r"cat > my-mesh/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", DOCS, re.S)
    assert m, "docs/deploy.md shows the overlay as a copyable heredoc"
    objs = build_overlay(m.group(1))
    for obj in objs:
        validate(obj)
    assert {"llm-teacher", "llm-autoscaler"} <= {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    find(objs, "Job", "llm-student")


def test_the_llm_only_append_in_the_docs_leaves_no_cifar_piece_behind() -> None:
    base = re.search(r"cat > my-mesh/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", DOCS, re.S)
    more = re.search(r"cat >> my-mesh/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", DOCS, re.S)
    assert base and more
    objs = build_overlay(base.group(1) + "\n" + more.group(1))
    for obj in objs:
        validate(obj)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not {n for n in names if n[1] in ("cifar-teacher", "distill-autoscaler", "student", "student-script")}
    assert ("Deployment", "llm-teacher") in names and ("Role", "llm-autoscaler") in names


def test_the_weights_upgrade_in_the_docs_points_the_teachers_at_the_new_claim() -> None:
    m = re.search(r"```\n  patches:\n(.*?)  ```", DOCS, re.S)
    claim = re.search(r"cat > my-mesh/weights-v2\.yaml <<'EOF'\n(.*?)\n  EOF\n", DOCS, re.S)
    assert m and claim, "docs/deploy.md shows the upgrade's claim and patch"
    patch = "patches:\n" + "\n".join(line.removeprefix("  ") for line in m.group(1).splitlines())
    claim_text = "\n".join(line.removeprefix("  ") for line in claim.group(1).splitlines())
    overlay = ("resources: [../deploy, weights-v2.yaml]\ncomponents: [../deploy/components/llm-teacher, "
               "../deploy/components/llm-weights-from-snapshot]\n" + patch)
    objs = build_overlay(overlay, {"weights-v2.yaml": claim_text})
    for obj in objs:
        validate(obj)
    dep = find(objs, "Deployment", "llm-teacher")
    (volume,) = pod_spec(dep)["volumes"]  # type: ignore[index]
    assert volume["persistentVolumeClaim"] == {"claimName": "llm-weights-v2", "readOnly": True}
    new_claim = find(objs, "PersistentVolumeClaim", "llm-weights-v2")
    assert new_claim["spec"]["accessModes"] == ["ReadOnlyMany"] and new_claim["metadata"]["namespace"] == "distill"
    assert new_claim["spec"]["dataSource"]["name"] == "llm-weights-v2"
    sed = re.search(r"sed 's/name: llm-weights\$/name: (llm-weights-v2)/' deploy/weights/snapshot\.yaml", DOCS)
    assert sed, "the snapshot is renamed for the new claim"
    snapshot = re.sub(r"name: llm-weights$", "name: llm-weights-v2",
                      (DEPLOY / "weights" / "snapshot.yaml").read_text(), flags=re.M)
    assert yaml.safe_load(snapshot)["metadata"]["name"] == "llm-weights-v2"


# The teachers' metric table lives in the operating guide (deploy.md links it); the autoscaler's in deploy.md.
@pytest.mark.parametrize("doc, section, sources, pattern", [
    ("docs/guides/operating.md", "## Teacher metrics", ("teacher_server/metrics.py", "teacher_server/device_memory.py"),
     r"(?:nv_inference|teacher)_[a-z_]+"),
    ("docs/deploy.md", "## Metrics", ("distill/autoscale/metrics.py",), r"distill_autoscaler_[a-z_]+"),
])  # fmt: skip
def test_documented_metric_names_exist(doc: str, section: str, sources: tuple[str, ...], pattern: str) -> None:
    text = (REPO / doc).read_text().split(section, 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(" + pattern + r")", text))
    assert len(documented) >= 5
    code = "".join((REPO / source).read_text() for source in sources)
    for name in documented:
        stems = {name, name.removeprefix("distill_autoscaler_")}  # gauges are named by their stem
        stems |= {s.removesuffix("_total") for s in stems}  # prometheus-client adds _total to counters
        assert any(f'"{s}"' in code for s in stems), f"{doc} documents {name}, {', '.join(sources)} have none"
