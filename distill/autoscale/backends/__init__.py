"""Where teachers come from: subprocesses on this machine (``local``) or a Kubernetes Deployment
(``kubernetes``). Both implement :class:`Backend`; the controller does not care which."""

from distill.autoscale.backends.base import Backend, BackendState
from distill.autoscale.backends.kubernetes import KubernetesBackend
from distill.autoscale.backends.local import LocalBackend

__all__ = ["BACKENDS", "Backend", "BackendState", "KubernetesBackend", "LocalBackend"]

BACKENDS: tuple[str, ...] = ("local", "kubernetes")
