"""deploy/components/vllm-teacher, rendered: llm-teacher's pod made a vLLM engine (the
vllm/vllm-openai server over N GPUs with N-way tensor parallelism, shared memory for its workers,
the weights from the same sources as llm-teacher, probes on /health sized for large weights) with
the registrar beside it as a native sidecar (its command parsed by the real `distill` parser), the
autoscaler still allowed only the Deployment's scale subresource, and the overlay docs/deploy.md
shows for it."""

from __future__ import annotations

import re
from typing import Any

from distill import cli as distill_cli
from distill.autoscale.cli import build_parser as autoscaler_parser
from distill.autoscale.cli import policy_from_args
from distill.gateway_cli import config_from_args
from teacher_server.registrar.engine import parse_engine
from tests.test_deploy_render import DEPLOY, IMAGE, REPO, build_overlay, container, find, pod_spec, validate, variant

Doc = dict[str, Any]
VLLM_IMAGE = "vllm/vllm-openai:"


def engine_flags(c: Doc) -> dict[str, str]:
    """vLLM's `--name=value` arguments (the manifest writes each flag once, with `=`)."""
    pairs = [a.removeprefix("--").split("=", 1) for a in c["args"]]
    assert all(len(p) == 2 for p in pairs), c["args"]
    flags = dict(pairs)
    assert len(flags) == len(pairs), "a vLLM flag twice"
    return flags


def registrar_args(dep: Doc) -> Any:
    """The sidecar's `distill register ...`, parsed by the real `distill` parser."""
    c = container(dep, "registrar")
    assert c["command"] == ["distill"]
    args = distill_cli.build_parser().parse_args(c["args"])
    assert args.command == "register" and args.engine_command == []  # a sidecar: the engine is its own container
    return args


def test_vllm_teacher_builds_and_validates_with_every_weights_source() -> None:
    for name in ("vllm", "vllm+weights-image+gateway"):
        objs = variant(name)
        for obj in objs:
            validate(obj)
        deps = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
        assert deps == {"cifar-teacher", "distill-autoscaler", "llm-teacher", "llm-autoscaler"}, name
    claim = pod_spec(find(variant("vllm"), "Deployment", "llm-teacher"))["volumes"][0]  # type: ignore[index]
    assert claim == {"name": "weights", "persistentVolumeClaim": {"claimName": "llm-weights", "readOnly": True}}
    image = pod_spec(find(variant("vllm+weights-image+gateway"), "Deployment", "llm-teacher"))["volumes"][0]  # type: ignore[index]
    assert set(image) == {"name", "image"} and image["name"] == "weights"


def test_the_pod_runs_vllm_over_n_gpus_with_shared_memory_and_the_weights_read_only() -> None:
    dep = find(variant("vllm"), "Deployment", "llm-teacher")
    spec = pod_spec(dep)
    assert spec is not None and [c["name"] for c in spec["containers"]] == ["vllm"]
    c = container(dep, "vllm")
    assert c["image"].startswith(VLLM_IMAGE) and c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    flags = engine_flags(c)
    gpus = int(flags["tensor-parallel-size"])
    assert gpus > 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus == c["resources"]["limits"]["nvidia.com/gpu"]
    assert int(flags["max-logprobs"]) == 20
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(flags["port"])} and flags["host"] == "0.0.0.0"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    weights = mounts["/models"]
    assert weights["readOnly"] is True and volumes[weights["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert flags["model"].startswith("/models/")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HOME"] in mounts, "caches on a writable volume, never a hub"
    assert "replicas" not in dep["spec"], "the autoscaler owns replicas"


def test_probes_wait_for_large_weights_and_the_grace_covers_the_drain() -> None:
    dep = find(variant("vllm"), "Deployment", "llm-teacher")
    c = container(dep, "vllm")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800, "30 minutes to load a 70B model"
    grace = pod_spec(dep)["terminationGracePeriodSeconds"]  # type: ignore[index]
    reg = registrar_args(dep)
    assert grace > reg.drain_timeout + reg.unhealthy_after * reg.probe_interval + 60  # + vLLM's in-flight work
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_the_registrar_is_a_native_sidecar_registering_the_engine_where_students_reach_it() -> None:
    objs = variant("vllm")
    dep = find(objs, "Deployment", "llm-teacher")
    (sidecar,) = pod_spec(dep)["initContainers"]  # type: ignore[index]
    assert sidecar["name"] == "registrar" and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == IMAGE
    args = registrar_args(dep)
    flags = engine_flags(container(dep, "vllm"))
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"] if "valueFrom" in e}
    assert env == {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"}
    address = parse_engine(args.engine, args.url.replace("$(POD_IP)", "10.1.2.3"))
    assert (address.kind, address.endpoint) == ("vllm", f"10.1.2.3:{flags['port']}"), "the pod IP, vLLM's port"
    assert args.model == flags["served-model-name"] and args.max_top_k == int(flags["max-logprobs"])
    assert args.instance_id == "$(POD_NAME)"
    scaler = autoscaler_parser().parse_args(container(find(objs, "Deployment", "llm-autoscaler"), "autoscaler")["args"])
    assert (args.registry, args.service) == (scaler.registry, scaler.service)
    assert scaler.start_timeout >= 1800, "an engine loading counts as capacity for as long as the startupProbe allows"


def test_the_autoscaler_may_only_scale_the_vllm_deployment() -> None:
    objs = variant("vllm")
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(objs, "Role", "llm-autoscaler")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["llm-teacher"], "verbs": ["get", "patch"]}]  # fmt: skip
    dep = find(objs, "Deployment", "llm-autoscaler")
    args = autoscaler_parser().parse_args(container(dep, "autoscaler")["args"])
    assert (args.backend, args.deployment) == ("kubernetes", "llm-teacher")
    assert pod_spec(dep)["serviceAccountName"] == find(objs, "RoleBinding", "llm-autoscaler")["subjects"][0]["name"]  # type: ignore[index]


def test_the_gateway_trainer_asks_the_service_the_registrar_registers() -> None:
    objs = variant("vllm+weights-image+gateway")
    (gw,) = pod_spec(find(objs, "Job", "llm-student"))["initContainers"]  # type: ignore[index]
    gateway = config_from_args(distill_cli.build_parser().parse_args(gw["command"][1:] + gw["args"]))
    reg = registrar_args(find(objs, "Deployment", "llm-teacher"))
    assert (gateway.registry, gateway.service) == (reg.registry, reg.service)


DOCS = (REPO / "docs" / "deploy.md").read_text()


def test_the_vllm_overlay_in_the_docs_builds_and_validates() -> None:
    section = DOCS.split("## A 70B teacher on vLLM", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"cat > my-vllm-mesh/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", section, re.S)
    assert m, "the section shows its overlay as a copyable heredoc"
    objs = build_overlay(m.group(1))
    for obj in objs:
        validate(obj)
    dep = find(objs, "Deployment", "llm-teacher")
    c = container(dep, "vllm")
    assert c["image"].startswith(VLLM_IMAGE)
    gpus = int(engine_flags(c)["tensor-parallel-size"])  # the overlay's patch replaced the right argument
    assert gpus == 2 == c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    registrar_args(dep)
    scaler = autoscaler_parser().parse_args(container(find(objs, "Deployment", "llm-autoscaler"), "autoscaler")["args"])
    policy = policy_from_args(scaler)
    assert policy.gpus_per_teacher == gpus and policy.upper == policy.gpu_budget // gpus == scaler.max_teachers  # type: ignore[operator]
    assert "components/vllm-teacher" in section and (DEPLOY / "components" / "vllm-teacher").is_dir()
    assert "distill gateway" in section and "tensor-parallel-size" in section
