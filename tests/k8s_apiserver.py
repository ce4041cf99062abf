"""A stand-in for the Kubernetes API server, for the ``kubernetes`` backend's tests.

No API server can run on the test machines (it needs etcd, certificates, a node agent to be
meaningful), so :class:`FakeApiServer` is a small HTTP server on 127.0.0.1 that serves what the
backend uses, with the JSON shapes and the behaviours of a real one that matter to it:

* ``GET``/``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``: an ``autoscaling/v1``
  ``Scale`` with ``metadata.resourceVersion`` and ``managedFields`` (who last set
  ``spec.replicas``); ``PATCH`` takes only ``application/merge-patch+json`` bodies that set
  ``spec.replicas`` (and optionally ``metadata.resourceVersion``), records ``?fieldManager=``.
* **resourceVersion**: one counter for the whole server (like etcd's revision); every write bumps
  it, and so does :meth:`status_update` (the Deployment controller writing status). A ``PATCH``
  carrying a ``metadata.resourceVersion`` that is not the current one gets ``409 Conflict`` with
  the real message ("the object has been modified ...") and changes nothing.
* **RBAC per verb**: each Deployment has a set of allowed verbs on ``deployments/scale``
  (``get`` and ``patch`` by default); a request whose verb is missing gets ``403 Forbidden`` with the
  real message. ``POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`` answers from the
  same table (``allowed`` plus a reason), as RBAC's authorizer does; ``ssar=False`` makes that
  endpoint 404, like an API server without it.
* **Pods that stay Pending**: ``pending[(ns, name)]`` pods of a Deployment never become ready;
  ``status.replicas`` still counts them (they exist), and :meth:`registry_view` lists only the ready
  ones, which is what the teacher pods' registrations in etcd would show.
* **429 Too Many Requests**: the next requests are refused while :attr:`throttle` holds
  ``Retry-After`` values (``None``: no header), as API Priority and Fairness does.
* **Another writer**: :meth:`set_replicas` resizes a Deployment as ``kubectl scale``, an HPA or a
  GitOps sync would, under their field manager name.

Every request is recorded in :attr:`requests`, so tests can check that the backend touches nothing
else and sends no request it was told to hold back.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s_client

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
VERB_OF = {"GET": "get", "PATCH": "patch", "PUT": "update", "DELETE": "delete", "POST": "create"}
DEFAULT_VERBS = frozenset({"get", "patch"})


class ReadyEntry:
    """What a registered, ready teacher looks like to the backend (a ``TeacherEntry`` without load)."""

    load = None


class FakeApiServer:
    """Stands in for the Kubernetes API server; see the module docstring."""

    def __init__(
        self,
        deployments: Mapping[tuple[str, str], int],
        *,
        forbidden: set[str] | None = None,
        verbs: Mapping[str, set[str]] | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.replicas = dict(deployments)
        self.version = 100
        self.versions = {key: self.version for key in self.replicas}
        self.managers = {key: ("kubectl-client-side-apply", 0) for key in self.replicas}
        self.verbs: dict[str, set[str]] = {name: set(v) for name, v in (verbs or {}).items()}
        for name in forbidden or ():
            self.verbs[name] = set()
        self.pending: dict[tuple[str, str], int] = {}
        self.throttle: list[float | None] = []
        self.ssar = True
        self.requests: list[dict[str, Any]] = []
        self.delay = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def _send(self, code: int, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                with fake.lock:
                    fake.requests.append({
                        "method": method, "path": self.path, "content_type": self.headers.get("Content-Type"),
                        "authorization": self.headers.get("Authorization"), "body": raw.decode() or None,
                        "query": query,
                    })  # fmt: skip
                    throttled = fake.throttle.pop(0) if fake.throttle else False
                if throttled is not False:
                    headers = {} if throttled is None else {"Retry-After": f"{throttled:g}"}
                    msg = "Too many requests, please try again later."
                    return self._send(429, fake.status(429, "TooManyRequests", msg), headers)
                if fake.delay:
                    time.sleep(fake.delay)
                if url.path == SSAR_PATH and method == "POST" and fake.ssar:
                    return self._send(201, fake.review(json.loads(raw or b"{}")))
                m = SCALE_PATH.match(url.path)
                if m is None:
                    return self._send(404, fake.status(404, "NotFound", f"the server could not find {self.path}"))
                ns, name = m.groups()
                verb = VERB_OF.get(method, method.lower())
                if verb not in fake.verbs.get(name, DEFAULT_VERBS):
                    return self._send(403, fake.status(403, "Forbidden", fake.forbidden_message(ns, name, verb), name))
                with fake.lock:
                    if (ns, name) not in fake.replicas:
                        msg = f'deployments.apps "{name}" not found'
                        return self._send(404, fake.status(404, "NotFound", msg, name))
                    if method == "PATCH":
                        return self._patch(ns, name, raw, query)
                    if method != "GET":
                        msg = f"{method} is not served by this stand-in"
                        return self._send(405, fake.status(405, "MethodNotAllowed", msg, name))
                    return self._send(200, fake.scale(ns, name))

            def _patch(self, ns: str, name: str, raw: bytes, query: dict[str, str]) -> None:
                if self.headers.get("Content-Type") != "application/merge-patch+json":
                    return self._send(415, fake.status(415, "UnsupportedMediaType", "unsupported patch type"))
                patch = json.loads(raw)
                replicas = patch.get("spec", {}).get("replicas")
                meta = patch.get("metadata", {})
                if (not isinstance(replicas, int) or replicas < 0 or not set(patch) <= {"spec", "metadata"}
                        or set(patch["spec"]) != {"replicas"} or not set(meta) <= {"resourceVersion"}):
                    return self._send(422, fake.status(422, "Invalid", f"bad scale patch {patch}", name))
                if "resourceVersion" in meta and meta["resourceVersion"] != str(fake.versions[(ns, name)]):
                    msg = (f'Operation cannot be fulfilled on deployments.apps "{name}": the object has been '
                           "modified; please apply your changes to the latest version and try again")
                    return self._send(409, fake.status(409, "Conflict", msg, name))
                fake._write(ns, name, replicas, query.get("fieldManager", "unknown"))
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

    # -- the model ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write(self, ns: str, name: str, replicas: int, manager: str) -> None:
        self.version += 1
        self.replicas[(ns, name)] = replicas
        self.versions[(ns, name)] = self.version
        self.managers[(ns, name)] = (manager, self.version)

    def set_replicas(self, ns: str, name: str, replicas: int, manager: str = "kubectl") -> None:
        """Another writer resizes the Deployment (``kubectl scale``, an HPA, a GitOps sync)."""
        with self.lock:
            self._write(ns, name, replicas, manager)

    def status_update(self, ns: str, name: str) -> None:
        """The Deployment controller updates status: the resourceVersion moves, the replicas do not."""
        with self.lock:
            self.version += 1
            self.versions[(ns, name)] = self.version

    def registry_view(self, ns: str, name: str) -> dict[str, ReadyEntry]:
        """The teachers of this Deployment that would be registered: its pods that are not Pending."""
        with self.lock:
            ready = max(0, self.replicas[(ns, name)] - self.pending.get((ns, name), 0))
        return {f"{name}-{i}": ReadyEntry() for i in range(ready)}

    def writes(self) -> list[dict[str, Any]]:
        """The PATCH requests received so far."""
        with self.lock:
            return [r for r in self.requests if r["method"] == "PATCH"]

    def scale(self, ns: str, name: str) -> dict[str, Any]:
        n = self.replicas[(ns, name)]
        manager, at = self.managers[(ns, name)]
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1735689600 + at))
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": name, "namespace": ns, "uid": "4f0c3a47-1b5e-4c8e-9a53-0d7b2f1e9c11",
                "resourceVersion": str(self.versions[(ns, name)]), "creationTimestamp": "2025-01-01T00:00:00Z",
                "managedFields": [{
                    "manager": manager, "operation": "Update", "apiVersion": "apps/v1", "time": stamp,
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}}}, "subresource": "scale",
                }],
            },
            "spec": {"replicas": n},
            "status": {"replicas": n, "selector": f"app.kubernetes.io/name={name}"},
        }  # fmt: skip

    def forbidden_message(self, ns: str, name: str, verb: str) -> str:
        user = f"system:serviceaccount:{ns}:distill-autoscaler"
        return (f'deployments.apps "{name}" is forbidden: User "{user}" cannot {verb} resource "deployments/scale" '
                f'in API group "apps" in the namespace "{ns}"')

    def review(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a SelfSubjectAccessReview from the per-verb table."""
        attrs = body.get("spec", {}).get("resourceAttributes", {})
        name, verb = attrs.get("name", ""), attrs.get("verb", "")
        ok = (attrs.get("group") == "apps" and attrs.get("resource") == "deployments"
              and attrs.get("subresource") == "scale" and verb in self.verbs.get(name, DEFAULT_VERBS))
        status: dict[str, Any] = {"allowed": ok}
        if ok:
            status["reason"] = 'RBAC: allowed by RoleBinding "distill-autoscaler" of Role "distill-autoscaler"'
        return {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                "metadata": {}, "spec": body.get("spec", {}), "status": status}

    @staticmethod
    def status(code: int, reason: str, message: str, name: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        }  # fmt: skip
        if name is not None:
            body["details"] = {"name": name, "group": "apps", "kind": "deployments"}
        return body

    # -- lifecycle ----------------------------------------------------------------------------------
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
