"""The ``kubernetes`` backend: resize the teacher Deployment through its ``scale`` subresource.

Why the scale subresource and nothing else: it is the one interface Kubernetes offers for "how
many replicas" (``kubectl scale`` and the HPA use it), and RBAC can grant exactly it, for one
Deployment (``deployments/scale`` with ``resourceNames``; see ``deploy/autoscaler-role.yaml``). The
backend reads it (``GET .../deployments/NAME/scale``) and patches ``spec.replicas`` (a JSON merge
patch); it never reads or writes pods, the Deployment itself or anything else. Which pod goes on a
scale-down is the ReplicaSet controller's choice; teacher pods drain on SIGTERM (deregister,
finish in-flight work) within their ``terminationGracePeriodSeconds``.

Configuration comes from the pod's service account when running in a cluster, else from a
kubeconfig (``--kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``), or from a ready
``kubernetes.client.Configuration`` (tests). The client is blocking: every call runs in a worker
thread with a request timeout, so the controller's event loop never waits on the API server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from discovery.aio import bounded, describe
from distill.autoscale.backends.base import Backend, BackendState
from distill.autoscale.errors import BackendError, BackendUnavailableError

__all__ = ["KubernetesBackend", "default_namespace"]

log = logging.getLogger("distill.autoscale.kubernetes")

_T = TypeVar("_T")
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace() -> str:
    """``$POD_NAMESPACE`` (downward API), else the service account's namespace, else ``default``."""
    env = os.environ.get("POD_NAMESPACE", "").strip()
    if env:
        return env
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def _import_kubernetes() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise BackendError(
            "the kubernetes backend needs the official client: pip install 'distill-mesh[kubernetes]' "
            "(or pip install kubernetes)"
        ) from None
    return kubernetes


class KubernetesBackend(Backend):
    """Scale the teacher Deployment ``deployment`` in ``namespace``; see the module docstring.

    Args:
        deployment: the teacher Deployment's name.
        namespace: its namespace (default: :func:`default_namespace`).
        kubeconfig: a kubeconfig file (default: in-cluster config when running in a pod, else
            ``$KUBECONFIG`` / ``~/.kube/config``).
        context: the kubeconfig context to use.
        configuration: a ready ``kubernetes.client.Configuration`` (overrides the two above).
        timeout: seconds allowed for each API call.
    """

    name = "kubernetes"

    def __init__(
        self,
        deployment: str,
        namespace: str | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        configuration: Any | None = None,
        timeout: float = 10.0,
    ) -> None:
        if not deployment:
            raise BackendError("the kubernetes backend needs --deployment NAME (the teacher Deployment)")
        if not timeout > 0:
            raise BackendError(f"the Kubernetes API timeout must be positive, not {timeout}")
        self.deployment = deployment
        self.namespace = namespace or default_namespace()
        self.kubeconfig = None if kubeconfig is None else str(kubeconfig)
        self.context = context
        self.timeout = float(timeout)
        self._configuration = configuration
        self._client: Any = None
        self._api: Any = None
        self._replicas: int | None = None
        self._pending_since: float | None = None
        self._closed = False

    @property
    def target(self) -> str:
        return f"deployment {self.namespace}/{self.deployment}"

    # -- plumbing -----------------------------------------------------------------------------------
    def _load_configuration(self) -> Any:
        k8s = _import_kubernetes()
        if self._configuration is not None:
            return self._configuration
        cfg = k8s.client.Configuration()
        in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ and self.kubeconfig is None and self.context is None
        try:
            if in_cluster:
                k8s.config.load_incluster_config(client_configuration=cfg)
            else:
                k8s.config.load_kube_config(
                    config_file=self.kubeconfig, context=self.context, client_configuration=cfg, persist_config=False
                )
        except (k8s.config.ConfigException, OSError, TypeError, ValueError) as e:
            where = "the pod's service account" if in_cluster else (self.kubeconfig or "$KUBECONFIG / ~/.kube/config")
            raise BackendError(
                f"cannot load the Kubernetes configuration from {where}: {e}. Outside a cluster pass "
                "--kubeconfig PATH (and --context NAME); inside, mount a service account token"
            ) from None
        return cfg

    async def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one blocking client call in a thread, bounded, with errors turned into ours."""
        k8s = _import_kubernetes()
        try:
            return await bounded(
                asyncio.to_thread(fn, *args, _request_timeout=self.timeout, **kwargs), self.timeout + 2.0
            )
        except k8s.client.exceptions.ApiException as e:
            status = int(getattr(e, "status", 0) or 0)
            message = _api_message(e)
            if status == 404:
                raise BackendError(
                    f"{self.target} not found ({message}): create it first (kubectl apply -k deploy/) or pass the "
                    "right --deployment and --namespace"
                ) from None
            if status in (401, 403):
                raise BackendError(
                    f"not allowed to {what} {self.target} (HTTP {status}: {message}): the autoscaler's service "
                    f"account needs get and patch on deployments/scale for {self.deployment!r} in {self.namespace!r} "
                    "(see deploy/autoscaler-role.yaml)"
                ) from None
            if 400 <= status < 500 and status not in (408, 409, 429):
                raise BackendError(f"could not {what} {self.target}: HTTP {status}: {message}") from None
            raise BackendUnavailableError(f"could not {what} {self.target}: HTTP {status}: {message}") from None
        except (TimeoutError, asyncio.TimeoutError):
            raise BackendUnavailableError(
                f"could not {what} {self.target}: no answer from the Kubernetes API within {self.timeout:g} s"
            ) from None
        except (OSError, ValueError) as e:
            raise BackendUnavailableError(f"could not {what} {self.target}: {describe(e)}") from None
        except Exception as e:  # urllib3 errors (MaxRetryError, ...) do not share a useful base
            if type(e).__module__.startswith("urllib3"):
                raise BackendUnavailableError(f"could not {what} {self.target}: {describe(e)}") from None
            raise

    async def read_replicas(self) -> int:
        """``spec.replicas`` of the Deployment's scale subresource."""
        if self._api is None:
            raise BackendError("the kubernetes backend is not started")
        scale = await self._call(
            "read the scale of", self._api.read_namespaced_deployment_scale, self.deployment, self.namespace
        )
        spec = getattr(scale, "spec", None)
        replicas = int(getattr(spec, "replicas", 0) or 0)
        self._replicas = replicas
        return replicas

    # -- Backend ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._api is not None:
            return
        if self._closed:
            raise BackendError("this backend is closed")
        k8s = _import_kubernetes()
        cfg = await asyncio.to_thread(self._load_configuration)
        self._client = k8s.client.ApiClient(cfg)
        self._api = k8s.client.AppsV1Api(self._client)
        try:
            replicas = await self.read_replicas()
        except BackendUnavailableError as e:
            await self.close()
            raise BackendError(f"{e}. Check --kubeconfig / the API server address") from None
        except BaseException:
            await self.close()
            raise
        log.info("kubernetes backend: %s has %d replica(s)", self.target, replicas)

    async def observe(self, teachers: Mapping[str, object]) -> BackendState:
        replicas = await self.read_replicas()
        ready = sum(1 for e in teachers.values() if not getattr(getattr(e, "load", None), "draining", False))
        missing = max(0, replicas - ready)
        now = time.monotonic()
        if missing == 0:
            self._pending_since = None
        elif self._pending_since is None:
            self._pending_since = now
        starting = (self._pending_since,) * missing if self._pending_since is not None else ()
        return BackendState(current=replicas, starting=starting, managed=None, detail=f"{replicas} replicas")

    async def scale(self, desired: int, teachers: Mapping[str, object]) -> None:
        if self._api is None:
            raise BackendError("the kubernetes backend is not started")
        desired = max(0, int(desired))
        body = {"spec": {"replicas": desired}}
        await self._call(
            "patch the scale of",
            self._api.patch_namespaced_deployment_scale,
            self.deployment,
            self.namespace,
            body,
            _content_type="application/merge-patch+json",
        )
        if self._replicas is not None and desired > self._replicas and self._pending_since is None:
            self._pending_since = time.monotonic()
        log.info("kubernetes backend: %s scaled to %d replica(s)", self.target, desired)
        self._replicas = desired

    async def close(self) -> None:
        self._closed = True
        client, self._client, self._api = self._client, None, None
        if client is not None:
            try:
                await bounded(asyncio.to_thread(client.close), 5.0)
            except Exception as e:
                log.debug("closing the Kubernetes client: %s", describe(e))


def _api_message(e: Any) -> str:
    """The ``message`` of a Kubernetes ``Status`` body, else the HTTP reason."""
    import json

    body = getattr(e, "body", None)
    if body:
        try:
            data = json.loads(body)
            if isinstance(data, dict) and data.get("message"):
                return str(data["message"])
        except (TypeError, ValueError):
            pass
    return str(getattr(e, "reason", "") or e)
