"""`teacher-server`: serve one PyTorch teacher over the KServe v2 gRPC protocol.

    teacher-server --model examples.refteacher:build --name ref_teacher --port 9898 --device cpu

SIGTERM or SIGINT drains: health goes NOT_SERVING, new requests get UNAVAILABLE, the registry
entry is revoked, in-flight requests finish (bounded by --drain-grace), and the process exits 0.

A thin layer over `teacher_server.serve`: the flags are built from the settings' declarations
(`teacher_server.options`), each flag is one of serve()'s keywords, and bad values are refused in
the flags' own words by the same checks serve() runs; building the config, loading, the warm-up,
registration and the drain are the API's, so the CLI and Python serving cannot drift.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from discovery.options import PASSWORD_ENV, add_registry_security_args, registry_security_options
from teacher_server import api
from teacher_server.api import RegistryAccessError, first_line
from teacher_server.config import ServerConfig, parse_model_args
from teacher_server.model import ModelLoadError
from teacher_server.options import CONFIG, GROUPS, SETTINGS, check_options
from teacher_server.settings import FLAGS, add_arguments, from_args
from teacher_server.spec import SpecError

__all__ = ["build_parser", "check_flags", "config_from_args", "main", "parse_model_args", "serve_options"]

log = logging.getLogger("teacher_server")


def build_parser() -> argparse.ArgumentParser:
    """The flags, one per declared setting (`teacher_server.options.SETTINGS`), in their groups."""
    p = argparse.ArgumentParser(
        prog="teacher-server",
        description="Serve a PyTorch teacher over the Triton / KServe v2 gRPC inference protocol.",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS if name}
    add_arguments(p, SETTINGS, groups)
    add_registry_security_args(groups["registry"])
    return p


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as serve()'s keywords (``--model-arg K=V`` as a dict, ``--drain-grace`` as
    ``drain_grace_s``, ``--no-dynamic-batching`` as ``dynamic_batching=False``, ...)."""
    return from_args(args, [s for s in SETTINGS if s.scope != "cli"])


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad flag values before anything loads: SpecError naming the flag, the value and the
    fix (a model can take minutes to load; a typo should cost none of them)."""
    check_options(flag_values(args), FLAGS)


def apply_model_path(args: argparse.Namespace) -> list[str]:
    """Put --model-path's directories (default: the working directory) first on sys.path, so
    that `--model mymodel:build` finds ./mymodel.py from the `teacher-server` script too (a script's
    sys.path starts with its own bin directory, not the working directory). Returns what was added."""
    dirs = [str(Path(d).resolve()) for d in (args.model_path or [os.getcwd()])]
    for d in args.model_path:
        if not Path(d).is_dir():
            raise SpecError(f"--model-path {d} is not a directory")
    for d in reversed(dirs):
        if d not in sys.path[: len(dirs)]:
            sys.path.insert(0, d)
    return dirs


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `teacher_server.server_config`'s keyword arguments, one to one."""
    return {k: v for k, v in flag_values(args).items() if k in CONFIG}


def serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `teacher_server.serve`'s keyword arguments (config, registry, ready file, threads)."""
    options = flag_values(args)
    if args.registry:
        options["registry_options"] = registry_security_options(args)
    return options


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig `teacher-server ARGS` serves (flags checked first)."""
    check_flags(args)
    return api.server_config(args.model, **config_options(args))


def _registry_refusal(e: RegistryAccessError) -> str:
    """RegistryAccessError in the flags' words: which flag to fix and where the password goes."""
    if e.user:
        return (f"--registry {e.registry}: etcd refused user {e.user} ({e.said}); check --registry-user and the "
                f"password in ${PASSWORD_ENV}")
    return (f"--registry {e.registry}: etcd requires authentication ({e.said}); pass --registry-user and export "
            f"its password in ${PASSWORD_ENV}")


def _refuse(parser: argparse.ArgumentParser, message: str) -> int:
    """A refused flag or file: one line on stderr, exit status 2 (argparse's own, for usage errors)."""
    print(f"{parser.prog}: error: {first_line(message, 2000)}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, check them, and hand them to `teacher_server.serve`; map its errors to an
    exit status: 2 for a refused flag, file or model, 1 when the server cannot serve (a port)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        check_flags(args)
        apply_model_path(args)
        abandoned = api.serve(args.model, **serve_options(args))
    except RegistryAccessError as e:
        return _refuse(parser, _registry_refusal(e))
    except ModelLoadError as e:
        log.error("%s", e)
        return 2
    except (SpecError, ValueError) as e:
        return _refuse(parser, str(e))
    except OSError as e:
        log.error("cannot serve: %s", e)
        return 1
    if abandoned:
        # A forward pass cannot be interrupted, and interpreter shutdown would join its thread:
        # the process would outlive --drain-grace by however long the pass takes. Its callers were
        # answered UNAVAILABLE and the registry entry is gone, so leave now.
        logging.shutdown()
        os._exit(0)
    return 0
