"""The registrar: an inference engine (vLLM, SGLang, Triton, teacher-server) in the mesh's
registry exactly while it is healthy (``distill register``).

Why a separate process: an engine too big for teacher-server (a 70B model over four GPUs in vLLM)
knows nothing of etcd. The registrar beside it probes the engine in its own protocol, registers a
record that says how to call it (``protocol``, ``path``, ``capabilities``), publishes its load
from its Prometheus metrics, and withdraws the record before the engine stops or while it does not
answer. Modules, by job:

* :mod:`~teacher_server.registrar.engine`: the ``--engine`` / ``--url`` an operator gives, parsed.
* :mod:`~teacher_server.registrar.probe`: what a probe answers; :mod:`~teacher_server.registrar.probes`
  (vLLM, SGLang) and :mod:`~teacher_server.registrar.kserve_probe`: readiness, health and the record.
* :mod:`~teacher_server.registrar.load`: metrics text to ``TeacherLoad``.
* :mod:`~teacher_server.registrar.supervisor`: the loop (wait, register, watch, withdraw, drain).
* :mod:`~teacher_server.registrar.child`: the engine as a child process (``-- COMMAND``).
* :mod:`~teacher_server.registrar.cli`: the command's flags and exit statuses.

Nothing is imported here: ``distill --help`` loads only the command's flags.
"""

