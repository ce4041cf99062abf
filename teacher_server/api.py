"""Serving a teacher from Python: ``teacher_server.serve(model, ...)``, the same server as the CLI.

    import teacher_server
    teacher_server.serve(MyNet(), name="ref_teacher", inputs=["INPUT:FP32:3,32,32"], outputs=["LOGITS:FP32:100"],
                         port=9898, device="cpu", registry="etcd://10.0.0.5:2379", service="cifar-teacher")

``serve`` blocks until SIGINT or SIGTERM and then drains exactly as ``teacher-server`` does
(refuse new work, deregister, finish in-flight work within ``drain_grace_s``). From async code,
``await start(model, ...)`` returns a running ``TeacherServer``; ``await server.stop()`` drains it.

What ``model`` may be:

* an ``nn.Module`` (moved to ``device``, put in eval mode) or any callable taking the input
  tensors in declaration order, batch first, and returning a tensor, a tuple/list of them, or a
  dict of them (named outputs);
* a string, as ``--model`` takes it: ``package.module:factory``, a TorchScript file or a
  ``torch.export`` ``.pt2`` file. ``model_path=`` adds directories to ``sys.path`` first (the CLI's
  ``--model-path``; the working directory is on it already when Python was started with ``-m``
  or a script in that directory).

Either way the model gets the CLI's checks: every option is validated before anything loads,
and the server runs one warm-up forward pass on zeros shaped like the declared inputs (outputs not
declared are inferred from it) before it reports SERVING; a model that fails it is never served.
``teacher-server`` is ``serve`` behind argparse, so the two cannot drift apart.

``preprocess`` and ``postprocess`` run per batch on the model instance's thread, around the model:
``preprocess(*inputs)`` returns the model's arguments (one tensor or a tuple), ``postprocess(output)``
what is sent back (for instance, picking one output or a softmax). Both see whole batches, so they
must keep the batch dimension first.

Why a function and not a class to subclass (as LitServe does): a teacher is a model that is
already written; wrapping it in a class would only move its ``forward``. The per-request hooks
people need for teachers are tokenizing and picking outputs, which ``preprocess`` and
``postprocess`` cover without a new abstraction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch

from discovery.aio import deadline
from discovery.signals import StopSignals
from teacher_server.malloc_tuning import tune_malloc
from teacher_server.model import FLOAT_OUTPUT_DTYPES, LoadedModel, _probe, load_model, resolve_device
from teacher_server.options import (
    CONFIG,
    LAUNCH,
    LaunchSettings,
    batching_config,
    check_options,
    declaration,
    launch_defaults,
    refuse_unknown,
    server_fields,
)
from teacher_server.server import (
    ServerConfig,
    TeacherServer,
    check_tls_files,
    configure_torch_threads,
    default_instances,
)
from teacher_server.settings import KEYWORDS
from teacher_server.spec import SpecError

__all__ = ["RegistryAccessError", "prepare", "serve", "server_config", "start"]

log = logging.getLogger("teacher_server")
_T = TypeVar("_T")

Hook = Callable[..., Any]
# Keywords of serve()/start()/prepare() that have no flag: they hand over Python objects.
_PYTHON_ONLY = ("preprocess", "postprocess", "model_path")


class _Pipeline(torch.nn.Module):
    """preprocess -> model -> postprocess as one module, so that the instance thread runs all three."""

    def __init__(self, model: Callable[..., Any], preprocess: Hook | None, postprocess: Hook | None) -> None:
        super().__init__()
        self.model = model
        self.preprocess = preprocess
        self.postprocess = postprocess

    def forward(self, *xs: torch.Tensor) -> Any:
        args: Any = xs
        if self.preprocess is not None:
            pre = self.preprocess(*xs)
            args = tuple(pre) if isinstance(pre, (tuple, list)) else (pre,)
        out = self.model(*args)
        return out if self.postprocess is None else self.postprocess(out)


def _add_model_path(model_path: str | Path | Sequence[str | Path] | None) -> None:
    if model_path is None:
        return
    dirs = [model_path] if isinstance(model_path, (str, Path)) else list(model_path)
    for d in reversed(dirs):
        if not Path(d).is_dir():
            raise SpecError(f"model_path {d} is not a directory")
        resolved = str(Path(d).resolve())
        if resolved not in sys.path:
            sys.path.insert(0, resolved)


def server_config(model: str, **options: Any) -> ServerConfig:
    """Check every option and build the ``ServerConfig`` that ``serve``, ``start`` and
    ``teacher-server`` run; loads nothing (a typo should not cost a model load).

    ``model`` is what the config records as the model's source (a ``module:factory`` string, a
    file, ``hf:DIR``). ``options``: the settings of ``teacher_server.options`` whose scope is the
    config, each with its flag's default: ``ServerConfig``'s fields (``name``, ``device``,
    ``instances``, ``http_port``, ``top_k``, ``drain_grace_s``, ``model_args``, ``tls_cert``, ...),
    the model's declaration (``inputs``, ``outputs``, ``attention_mask``, ``model_config``) and
    batching (``max_batch_size``, ``max_queue_delay_us``, ``max_queue_size``, ``max_batch_tokens``,
    ``length_buckets``, ``dynamic_batching``, ``async_outputs``). Raises SpecError naming the option and the fix.
    """
    refuse_unknown(options, CONFIG)
    check_options(options, KEYWORDS)
    io, file_cfg = declaration(options).resolve(KEYWORDS)
    batching = batching_config(options, file_cfg.max_batch_size if file_cfg else None, KEYWORDS)
    fields = server_fields(options)
    if not fields["instances"]:
        fields["instances"] = default_instances(fields["device"])
    config = ServerConfig(model=model, io=io, batching=batching, **fields)
    check_tls_files(config)
    return config


def _build(model: Any, *, preprocess: Hook | None = None, postprocess: Hook | None = None,
           model_path: str | Path | Sequence[str | Path] | None = None,
           **kwargs: Any) -> tuple[ServerConfig, LoadedModel | None]:
    """The config, and for a model object the LoadedModel that wraps it (not yet warmed up);
    None for a model given by reference, which TeacherServer.start() loads as the CLI does."""
    source = model if isinstance(model, str) else f"<python {type(model).__name__}>"
    config = server_config(source, **kwargs)
    _add_model_path(model_path)
    if isinstance(model, str):
        if preprocess is not None or postprocess is not None:
            raise SpecError("preprocess= and postprocess= need the model itself, not a reference to load")
        return config, None
    if not callable(model):
        raise SpecError(f"model must be an nn.Module, a callable or a 'module:factory' string, "
                        f"not {type(model).__name__}")
    if config.model_args:
        raise SpecError("model_args= configures a 'module:factory' string; call your factory yourself instead")
    dev = resolve_device(config.device)
    if isinstance(model, torch.nn.Module):
        model = model.to(dev).eval()
    declared = config.io or getattr(model, "io_spec", None)
    if declared is None or not declared.inputs:
        raise SpecError("the model declares no inputs: pass inputs=['NAME:DATATYPE:SHAPE', ...] (outputs= too, "
                        "or they are inferred), model_config=, or set an io_spec (teacher_server.ModelIO) on it")
    module = model if preprocess is None and postprocess is None else _Pipeline(model, preprocess, postprocess)
    return config, LoadedModel(module, declared, dev, FLOAT_OUTPUT_DTYPES[config.compute_dtype])


def prepare(model: Any, **kwargs: Any) -> tuple[ServerConfig, LoadedModel]:
    """Check every option, load the model and run its warm-up forward, returned so that a caller
    may build ``TeacherServer(config, model)`` itself (whose ``start()`` warms it up once more:
    a forward pass on a batch of two, the price of a server that never serves an unchecked model).

    Takes ``server_config``'s arguments plus ``preprocess``, ``postprocess`` and ``model_path``.
    Raises SpecError for a bad option or declaration, ModelLoadError for a model that does not
    load or run.
    """
    config, loaded = _build(model, **kwargs)
    if loaded is None:
        return config, load_model(config.model, device=config.device, io=config.io,
                                  compute_dtype=config.compute_dtype, model_args=config.model_args)
    loaded.io = _probe(loaded)  # the warm-up: only a model that runs gets served
    return config, loaded


class RegistryAccessError(Exception):
    """etcd refused our credentials: registering would be retried forever while the teacher
    serves unregistered, so the teacher refuses to start instead. ``user`` is the etcd user
    that was refused (None: none was given and etcd requires one); ``said`` is etcd's reason."""

    def __init__(self, registry: str, user: str | None, said: str) -> None:
        self.registry, self.user, self.said = registry, user, said
        fix = ("check the user name and its password" if user else
               "give registry_options={'username': ..., 'password': ...}")
        who = f"refused user {user}" if user else "requires authentication"
        super().__init__(f"registry {registry}: etcd {who} ({said}); {fix}")


# What etcd says when it refuses the user, the password or the permissions.
_AUTH_REFUSALS = ("authentication failed", "invalid user id or password", "user name is empty",
                  "permission denied", "unauthenticated")
_REGISTRY_CHECK_S = 3.0


async def check_registry_access(registry: str, service: str, options: dict[str, Any]) -> None:
    """One read of the registry before the model loads: an authentication refusal is fatal
    (RegistryAccessError); an etcd that is down is not (registration retries in the background,
    as ever), it only earns a warning."""
    from discovery import RegistryError, open_registry

    reg = open_registry(registry, connect_timeout=_REGISTRY_CHECK_S, **options)
    try:
        async with reg, deadline(2 * _REGISTRY_CHECK_S):
            await reg.teachers(service)
    except (RegistryError, OSError, TimeoutError) as e:
        text = str(e) or type(e).__name__
        if any(marker in text.lower() for marker in _AUTH_REFUSALS):
            found = re.search(r"etcdserver: [^);]*", text)
            raise RegistryAccessError(registry, options.get("username"),
                                      found.group(0) if found else first_line(text)) from None
        log.warning("registry %s not reachable yet (%s); serving, registration retries in the background",
                    registry, first_line(text))


def first_line(text: str, limit: int = 300) -> str:
    """The first line of an error text, cut at `limit` characters: what a one-line error shows."""
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[:limit] + "..."


def _registration(registry: str, service: str, ttl: float,
                  security: dict[str, Any]) -> Callable[[TeacherServer], AbstractAsyncContextManager[object]]:
    from discovery import open_registry  # here: an unregistered teacher does not need etcd's client

    reg = open_registry(registry, **security)

    @contextlib.asynccontextmanager
    async def register(server: TeacherServer) -> AsyncIterator[object]:
        async with reg, reg.register(service, server.record(), ttl=ttl, load=server.load) as lease:
            yield lease

    return register


async def start(model: Any, **kwargs: Any) -> TeacherServer:
    """Load, warm up and start a teacher from async code; returns the running ``TeacherServer``.

    Takes ``serve``'s arguments except registration (use ``discovery``'s ``register()`` with
    ``server.record()`` for that), ``ready_file``, ``threads`` and ``malloc_tuning`` (settings of
    the whole process, which stays the caller's). Loading and the warm-up run on a worker thread, so
    the event loop keeps running meanwhile. Stop it with ``await server.stop()``
    (drains first).
    """
    config, loaded = await asyncio.to_thread(_build, model, **kwargs)
    server = TeacherServer(config, loaded)
    try:
        await server.start()
    except BaseException:
        await server.stop(0)
        raise
    return server


def serve(model: Any, *, registry_options: dict[str, Any] | None = None, **options: Any) -> int:
    """Serve ``model`` until SIGINT or SIGTERM, then drain; the blocking form (call it from the main
    thread: it installs the signal handlers). ``teacher-server`` is this function behind argparse:
    its keywords are the flags' (``teacher_server.options.SETTINGS``), with the flags' defaults
    (``port=8001``, Triton's gRPC port; ``instances``: one per usable core on CPU, 2 on GPU).

    ``inputs``/``outputs``: declarations ``"NAME:DATATYPE:D1,D2"`` (or ``TensorSpec``) in
    ``forward()`` order, batch dimension left out; outputs are inferred when not declared.
    ``registry``/``service``/``ttl``: register in etcd under a lease for as long as it serves
    (``registry_options``: ``discovery.open_registry``'s TLS and credential options); credentials
    etcd refuses stop it before the model loads (RegistryAccessError).
    ``ready_file``: written with ``{endpoint, port, pid, ...}`` as JSON once serving.
    ``threads``: torch intra-op threads (default: the usable cores shared out between the instances).
    ``malloc_tuning``: fix glibc malloc's thresholds for the process (`teacher_server.malloc_tuning`;
    default True), so each batch does not fault its working memory in again.
    Everything else goes to ``prepare`` (device, max_batch_size, preprocess, instances, ...).
    The port opens before the model loads and warms up (health NOT_SERVING meanwhile), so a
    load failure is reported with the port already answering, as with the CLI.
    Returns the number of forward passes still running when the drain grace ran out (0: clean).
    """
    refuse_unknown(options, {**CONFIG, **LAUNCH}, _PYTHON_ONLY)
    given = {k: v for k, v in options.items() if k in LAUNCH}
    check_options(given, KEYWORDS)
    launch = LaunchSettings(**given)
    if launch.malloc_tuning:  # before the model loads: its memory is the allocator's too
        tuning = tune_malloc()
        log.info("malloc: %s", tuning.detail)
    rest = {k: v for k, v in options.items() if k not in LAUNCH}
    config, loaded = _build(model, **{**launch_defaults(), **rest})
    registration = None
    if launch.registry is not None and launch.service is not None:
        security = dict(registry_options or {})
        registration = _registration(launch.registry, launch.service, launch.ttl, security)
        run_async(check_registry_access(launch.registry, launch.service, security))
    configure_torch_threads(launch.threads or None, config.instances)
    return run_async(run_until_signal(TeacherServer(config, loaded), registration, launch.ready_file))


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run on uvloop where it exists (Linux, macOS), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.run(coro)
    else:
        return uvloop.run(coro)


def _write_ready_file(path: str | Path, server: TeacherServer) -> None:
    """Written once, atomically (write then rename): a reader never sees half a file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"endpoint": server.endpoint, "port": server.port, "metrics_port": server.metrics_port,
                               "http_port": server.http_port, "pid": os.getpid(),
                               "instance_id": server.instance_id}))
    tmp.replace(path)


async def run_until_signal(server: TeacherServer,
                 registration: Callable[[TeacherServer], AbstractAsyncContextManager[object]] | None,
                 ready_file: str | Path | None) -> int:
    """The lifecycle `teacher-server` and `serve()` share: start, register, wait for SIGTERM/SIGINT,
    refuse new work, deregister, drain. Returns the number of forward passes left running when the
    drain grace ran out (0 after a clean drain)."""
    stop = StopSignals().install()
    try:
        await server.start()
        async with contextlib.AsyncExitStack() as stack:
            if registration is not None:
                await stack.enter_async_context(registration(server))
            if ready_file is not None:
                _write_ready_file(ready_file, server)
            await stop.wait()
            log.info("signal received: draining")
            await server.begin_drain()
        await server.stop()
        if server.abandoned_batches:
            log.warning("stopped with %d forward pass(es) still running after the drain grace",
                        server.abandoned_batches)
        else:
            log.info("stopped cleanly")
        return server.abandoned_batches
    finally:
        await server.stop(0)
        stop.uninstall()
