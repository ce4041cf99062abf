"""Autoscaling the teacher pool to the students' demand.

* :mod:`~distill.autoscale.policy`: a pure function from a snapshot of teachers and students to a
  teacher count and a reason (:func:`decide`), tested over simulated hours without a cluster.
* :mod:`~distill.autoscale.controller`: reads the registry each period, asks the policy, applies
  through a backend; one active controller per service (the registry's election, on etcd
  :class:`LeaderElection`); logs
  every decision and exports Prometheus metrics.
* :mod:`~distill.autoscale.backends`: ``local`` (teacher-server subprocesses) and ``kubernetes``
  (a Deployment's scale subresource).
* ``distill-autoscaler`` / ``python -m distill.autoscale``: :mod:`~distill.autoscale.cli`.
"""

from discovery.etcd.election import LeaderElection, leader_key
from distill.autoscale.backends import Backend, BackendState, KubernetesBackend, LocalBackend
from distill.autoscale.controller import Controller, ControllerConfig
from distill.autoscale.errors import (
    AutoscaleError,
    BackendError,
    BackendUnavailableError,
    ElectionError,
    PolicyConfigError,
)
from distill.autoscale.metrics import AutoscalerMetrics
from distill.autoscale.policy import (
    Decision,
    PolicyConfig,
    PolicyState,
    ScaleSnapshot,
    StudentSample,
    TeacherSample,
    decide,
)

__all__ = [
    "AutoscaleError",
    "AutoscalerMetrics",
    "Backend",
    "BackendError",
    "BackendState",
    "BackendUnavailableError",
    "Controller",
    "ControllerConfig",
    "Decision",
    "ElectionError",
    "KubernetesBackend",
    "LeaderElection",
    "LocalBackend",
    "PolicyConfig",
    "PolicyConfigError",
    "PolicyState",
    "ScaleSnapshot",
    "StudentSample",
    "TeacherSample",
    "decide",
    "leader_key",
]
