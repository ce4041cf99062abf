"""The ``kubernetes`` backend: resize the teacher Deployment through its ``scale`` subresource.

Why the scale subresource and nothing else: it is the one interface Kubernetes offers for "how
many replicas" (``kubectl scale`` and the HPA use it), and RBAC can grant exactly it, for one
Deployment (``deployments/scale`` with ``resourceNames``; see ``deploy/autoscaler-role.yaml``). The
backend reads it (``GET .../deployments/NAME/scale``) and patches ``spec.replicas`` (a JSON merge
patch); it never reads or writes pods, the Deployment itself or anything else. Which pod goes on a
scale-down is the ReplicaSet controller's choice; teacher pods drain on SIGTERM (deregister,
finish in-flight work) within their ``terminationGracePeriodSeconds``.

How it behaves towards the API server and other writers:

* **Permissions, per verb, at start.** A ``SelfSubjectAccessReview`` for each of :attr:`VERBS`
  (``get`` and ``patch`` on ``deployments/scale``), so a Role that lacks ``patch`` fails at start
  naming that verb, instead of at the first scale-up hours later.
* **Optimistic concurrency.** Every write carries the ``resourceVersion`` of the read the decision
  was taken on (a merge patch with ``metadata.resourceVersion``). On ``409 Conflict`` the backend
  reads again: if only the version moved (the Deployment's status changed), it writes again on the
  new version; if ``spec.replicas`` moved, someone else resized the pool, and it raises
  :class:`BackendConflictError` without writing, so the controller decides again on the new count.
* **Throttling.** On ``429 Too Many Requests`` no request is sent until the ``Retry-After`` the
  server named has passed (capped at :attr:`MAX_RETRY_AFTER`); calls meanwhile fail at once with
  :class:`~distill.autoscale.errors.BackendUnavailableError`, so the controller holds its count.
* **Other writers.** Writes name the field manager :attr:`FIELD_MANAGER`; when the Scale carries
  ``managedFields``, the manager that last set ``spec.replicas`` (``kubectl``, an HPA's
  ``kube-controller-manager``, a GitOps tool) shows in the state's ``detail``, which the controller
  logs when the count changes under it.
* **Starting replicas.** Replicas the Deployment asks for but that have not registered in etcd (pods
  Pending for lack of a GPU, pulling an image, loading the model) are reported as *starting*, one
  start time per missing replica, never as ready capacity: readiness is registration.

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

__all__ = ["BackendConflictError", "KubernetesBackend", "default_namespace"]

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


class _NoReview(Exception):
    """The API server would not answer a SelfSubjectAccessReview (absent or forbidden)."""


class BackendConflictError(BackendUnavailableError):
    """Another writer changed ``spec.replicas`` between our read and our write (HTTP 409).

    Nothing was written. Transient: the controller takes the new count as the current one and
    decides again; see :class:`KubernetesBackend`.
    """


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
        clock: the monotonic clock of ``Retry-After`` waits and starting times (tests pass their own).
    """

    name = "kubernetes"
    #: The verbs on ``deployments/scale`` this backend uses and checks at start; the Role in
    #: ``deploy/autoscaler-role.yaml`` grants exactly these.
    VERBS: tuple[str, ...] = ("get", "patch")
    #: The ``fieldManager`` of our writes, so other tools (and we) can tell who set the count.
    FIELD_MANAGER = "distill-autoscaler"
    #: Writes retried when only the resourceVersion moved (status updates) before giving up this period.
    CONFLICT_RETRIES = 3
    #: The longest ``Retry-After`` honoured, in seconds (a larger one is capped to this).
    MAX_RETRY_AFTER = 120.0

    def __init__(
        self,
        deployment: str,
        namespace: str | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        configuration: Any | None = None,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
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
        self._clock = clock
        self._configuration = configuration
        self._client: Any = None
        self._api: Any = None
        self._auth: Any = None
        self._replicas: int | None = None
        self._created: int | None = None
        self._version: str | None = None
        self._writer: str | None = None
        self._starting: list[float] = []
        self._not_before = 0.0
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

    def _permission_error(self, verbs: list[str], why: str) -> BackendError:
        missing = " and ".join(verbs)
        return BackendError(
            f"not allowed to {missing} deployments/scale of {self.target} ({why}): the autoscaler's service "
            f"account needs {' and '.join(self.VERBS)} on deployments/scale for {self.deployment!r} in "
            f"{self.namespace!r}; missing verb{'s' if len(verbs) > 1 else ''}: {', '.join(verbs)} "
            "(see deploy/autoscaler-role.yaml)"
        )

    async def _call(self, what: str, fn: Callable[..., _T], *args: Any, review: bool = False, **kwargs: Any) -> _T:
        """Run one blocking client call in a thread, bounded, with errors turned into ours.

        ``review``: the call is an access review, whose 403/404 mean "cannot review", not "the
        Deployment is missing" or "forbidden to scale" (:class:`_NoReview`).
        """
        k8s = _import_kubernetes()
        wait = self._not_before - self._clock()
        if wait > 0:
            raise BackendUnavailableError(
                f"not trying to {what} {self.target} for another {wait:.1f} s: the API server answered 429 Too "
                "Many Requests and asked to wait (Retry-After)"
            )
        try:
            return await bounded(
                asyncio.to_thread(fn, *args, _request_timeout=self.timeout, **kwargs), self.timeout + 2.0
            )
        except k8s.client.exceptions.ApiException as e:
            status = int(getattr(e, "status", 0) or 0)
            message = _api_message(e)
            if review and status in (401, 403, 404):
                raise _NoReview(f"HTTP {status}: {message}") from None
            if status == 404:
                raise BackendError(
                    f"{self.target} not found ({message}): create it first (kubectl apply -k deploy/) or pass the "
                    "right --deployment and --namespace"
                ) from None
            if status in (401, 403):
                verb = "patch" if "patch" in what else "get"
                raise self._permission_error([verb], f"HTTP {status}: {message}") from None
            if status == 409:
                raise BackendConflictError(f"could not {what} {self.target}: HTTP 409: {message}") from None
            if status == 429:
                delay = _retry_after(getattr(e, "headers", None), self.MAX_RETRY_AFTER)
                self._not_before = self._clock() + delay
                raise BackendUnavailableError(
                    f"could not {what} {self.target}: HTTP 429 Too Many Requests ({message}); waiting {delay:g} s "
                    "as the API server asked (Retry-After)"
                ) from None
            if 400 <= status < 500 and status != 408:
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
        """``spec.replicas`` of the Deployment's scale subresource (and remember its resourceVersion,
        the created count and who last set the replicas)."""
        if self._api is None:
            raise BackendError("the kubernetes backend is not started")
        scale = await self._call(
            "read the scale of", self._api.read_namespaced_deployment_scale, self.deployment, self.namespace
        )
        return self._remember(scale)

    def _remember(self, scale: Any) -> int:
        """Keep what a Scale (read, or returned by a write) says; return its ``spec.replicas``."""
        spec, status, meta = (getattr(scale, k, None) for k in ("spec", "status", "metadata"))
        replicas = int(getattr(spec, "replicas", 0) or 0)
        self._replicas = replicas
        self._created = None if status is None else int(getattr(status, "replicas", 0) or 0)
        self._version = getattr(meta, "resource_version", None)
        self._writer = _replicas_manager(getattr(meta, "managed_fields", None))
        return replicas

    async def check_permissions(self) -> None:
        """Ask the API server, per verb of :attr:`VERBS`, whether we may use ``deployments/scale``.

        Raises :class:`BackendError` naming every missing verb. Where SelfSubjectAccessReview is
        itself unavailable (an old or locked-down API server), logs that ``patch`` will only be
        checked at the first scale and returns: the read at start still checks ``get``.
        """
        k8s = _import_kubernetes()
        missing: list[str] = []
        reasons: list[str] = []
        for verb in self.VERBS:
            review = k8s.client.V1SelfSubjectAccessReview(
                spec=k8s.client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=k8s.client.V1ResourceAttributes(
                        namespace=self.namespace, verb=verb, group="apps", resource="deployments",
                        subresource="scale", name=self.deployment,
                    )
                )
            )  # fmt: skip
            try:
                answer = await self._call(
                    f"review the {verb} permission on",
                    self._auth.create_self_subject_access_review,
                    review,
                    review=True,
                )
            except _NoReview as e:
                log.warning(
                    "kubernetes backend: cannot check permissions with a SelfSubjectAccessReview (%s); "
                    "'patch' on deployments/scale will be checked at the first scale",
                    e,
                )
                return
            status = getattr(answer, "status", None)
            if not getattr(status, "allowed", False) or getattr(status, "denied", False):
                missing.append(verb)
                reason = getattr(status, "reason", None) or getattr(status, "evaluation_error", None)
                if reason:
                    reasons.append(f"{verb}: {reason}")
        if missing:
            why = "; ".join(reasons) or "denied by a SelfSubjectAccessReview"
            raise self._permission_error(missing, why)

    # -- Backend ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._api is not None:
            return
        if self._closed:
            raise BackendError("this backend is closed")
        k8s = _import_kubernetes()
        cfg = await asyncio.to_thread(self._load_configuration)
        cfg = _without_retry_after_sleeps(cfg)
        self._client = k8s.client.ApiClient(cfg)
        self._api = k8s.client.AppsV1Api(self._client)
        self._auth = k8s.client.AuthorizationV1Api(self._client)
        try:
            await self.check_permissions()
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
        # One start time per missing replica: new gaps start now; when some register, the newest go
        # first, so a pod Pending for long keeps its age and shows as late, not as fresh capacity.
        now = self._clock()
        del self._starting[missing:]
        self._starting.extend([now] * (missing - len(self._starting)))
        detail = f"{replicas} replicas"
        if self._created is not None and self._created < replicas:
            detail += f", {self._created} created"
        if missing:
            detail += f", {missing} not registered"
        if self._writer is not None and self._writer != self.FIELD_MANAGER:
            detail += f"; spec.replicas last set by {self._writer!r}"
        return BackendState(current=replicas, starting=tuple(self._starting), managed=None, detail=detail)

    async def scale(self, desired: int, teachers: Mapping[str, object]) -> None:
        if self._api is None:
            raise BackendError("the kubernetes backend is not started")
        desired = max(0, int(desired))
        if self._version is None:
            await self.read_replicas()
        for _ in range(self.CONFLICT_RETRIES):
            base = self._replicas
            body = {"metadata": {"resourceVersion": self._version}, "spec": {"replicas": desired}}
            try:
                written = await self._call(
                    "patch the scale of",
                    self._api.patch_namespaced_deployment_scale,
                    self.deployment,
                    self.namespace,
                    body,
                    field_manager=self.FIELD_MANAGER,
                    _content_type="application/merge-patch+json",
                )
            except BackendConflictError:
                now = await self.read_replicas()
                if now != base:
                    by = f" by {self._writer!r}" if self._writer and self._writer != self.FIELD_MANAGER else ""
                    raise BackendConflictError(
                        f"{self.target} was resized to {now}{by} while this autoscaler was scaling it from {base} "
                        f"to {desired}; nothing written, deciding again on the new count"
                    ) from None
                continue  # only the resourceVersion moved (a status update): write again on the new one
            log.info("kubernetes backend: %s scaled to %d replica(s)", self.target, desired)
            self._remember(written)
            self._replicas, self._writer = desired, self.FIELD_MANAGER
            return
        raise BackendUnavailableError(
            f"could not patch the scale of {self.target}: its resourceVersion changed under "
            f"{self.CONFLICT_RETRIES} writes in a row (409 Conflict); trying again next period"
        )

    async def close(self) -> None:
        self._closed = True
        client, self._client, self._api, self._auth = self._client, None, None, None
        if client is not None:
            try:
                await bounded(asyncio.to_thread(client.close), 5.0)
            except Exception as e:
                log.debug("closing the Kubernetes client: %s", describe(e))


def _without_retry_after_sleeps(cfg: Any) -> Any:
    """A copy of ``cfg`` whose HTTP retries do not sleep on ``Retry-After``.

    Why: by default urllib3 (under the official client) answers a 429 by sleeping its Retry-After
    in the worker thread and retrying, so the call just times out and the wait is invisible. The
    backend honours Retry-After itself, without holding a thread; connection errors are still
    retried.
    """
    import copy

    from urllib3.util.retry import Retry

    cfg = copy.deepcopy(cfg)
    cfg.retries = Retry(total=3, status=0, respect_retry_after_header=False, raise_on_status=False)
    return cfg


def _retry_after(headers: Any, cap: float) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds; Kubernetes sends no dates), default 1 s."""
    value = None
    if headers is not None:
        try:
            value = headers.get("Retry-After")
        except AttributeError:
            value = None
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    if not seconds >= 0:  # NaN or negative
        seconds = 1.0
    return min(seconds, cap)


def _replicas_manager(entries: Any) -> str | None:
    """The field manager that owns ``spec.replicas`` in a Scale's ``managedFields`` (latest wins)."""
    owner, latest = None, None
    for entry in entries or ():
        fields = getattr(entry, "fields_v1", None)
        if isinstance(fields, Mapping) and "f:replicas" in (fields.get("f:spec") or {}):
            when = getattr(entry, "time", None)
            if owner is None or (when is not None and (latest is None or when >= latest)):
                owner, latest = getattr(entry, "manager", None), when
    return None if owner is None else str(owner)


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
