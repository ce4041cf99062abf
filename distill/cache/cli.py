"""``distill cache``: look at a teacher-output store.

    distill cache info PATH            # namespace, samples, bytes per sample and per token, shards
    distill cache info PATH --json     # the same as JSON, for scripts
    distill cache info PATH --remove-torn   # also delete shards torn by writers that died on this host
    distill cache verify PATH          # check every stored record against its checksum; exit 1 on damage
    distill record --teachers HOST:PORT --cache PATH --loader my_data:loader --inputs X --key index
    distill record --registry etcd://HOST:2379 --service NAME --cache PATH --inputs X -- python -m my_data [ARGS]
                                       # fill a store from a loader at full teacher throughput (resumable)

This module imports pyarrow and torch only when a subcommand runs, so ``distill --help`` and
``distill top`` stay fast and work without the ``cache`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from distill.flags import add_transform_args

__all__ = ["add_arguments", "add_parser", "add_record_arguments", "add_record_parser", "main", "record", "run"]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``cache`` subcommands to ``p``."""
    sub = p.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND", required=True)
    info = sub.add_parser(
        "info", help="print a store's namespace, samples, bytes per sample and per token, and shards",
        description="Print a teacher-output store's namespace, samples (distinct keys), stored bytes per sample "
        "and per token, and its shards: sealed, unsealed (being written, or torn by a writer that died: never "
        "read, their samples are misses) and rejected (unreadable, or of another namespace). "
        "Exit 1 when PATH holds no store.",
    )
    info.add_argument("path", metavar="PATH", help="the store's directory")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--max-shards", type=int, default=20, help="list at most this many sealed shards (text)")
    info.add_argument("--remove-torn", action="store_true",
                      help="delete torn shards whose writer on this host is gone")
    verify = sub.add_parser(
        "verify", help="check every stored record against its checksum; exit 1 if any is damaged",
        description="Read a whole teacher-output store and check every record (the rows of one append: a batch of "
        "teacher answers) against the checksum written with it. Prints each damaged record (shard, keys), each "
        "shard whose file structure is damaged, each shard written before checksums (unverifiable), and a "
        "summary. Exit 1 when anything is damaged or PATH holds no store, else 0 (unverifiable shards do not "
        "fail it).",
    )
    verify.add_argument("path", metavar="PATH", help="the store's directory")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_record_arguments(sub.add_parser("record", help=_RECORD_HELP, description=_RECORD_DESCRIPTION))
    return p


_RECORD_HELP = "fill a teacher-output store from a loader, at full teacher throughput (resumable)"
_RECORD_DESCRIPTION = (
    "Drive a loader through the teachers and store their outputs, keyed by each sample's key, so that training "
    "runs read them instead of asking a teacher (DistillReader(..., cache=PATH)). Resumable: batches whose "
    "samples are all stored are skipped, and of the others only the missing samples go to a teacher. "
    "The loader is either --loader MODULE:FUNCTION, a callable returning it, or, after --, `python -m MODULE "
    "[ARGS...]`: MODULE is imported in this process with sys.argv = [MODULE, *ARGS] (its __main__ block does not "
    "run) and must define loader(), a function of no arguments returning the iterable of batches. Batches are "
    "dicts (or tuples) holding the teacher inputs and the key field. The store's namespace is the teacher's "
    "model name and version and the output settings given here: train with the same settings. Python code can "
    "call distill.cache.record(loader, cache=..., teachers=... or registry=..., inputs=..., key=...) instead."
)


def add_record_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``distill record`` (also ``distill cache record``)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--teachers", metavar="HOST:PORT[,HOST:PORT]", help="a fixed set of teachers")
    where.add_argument("--registry", metavar="etcd://HOST:2379", help="find teachers in this registry")
    p.add_argument("--service", metavar="NAME", help="the service the teachers register under (with --registry)")
    p.add_argument("--cache", required=True, metavar="PATH", help="the store's directory (created if needed)")
    p.add_argument("--loader", metavar="MODULE:FUNCTION",
                   help="a callable returning the loader, e.g. my_dataset:train_loader (or: -- python -m MODULE)")
    p.add_argument("--key", default="index", metavar="FIELD",
                   help="the batch field holding each sample's key (a dict key, or a tuple position as a "
                   "number) (default: %(default)s)")
    p.add_argument("--inputs", required=True, metavar="NAME[,NAME]",
                   help="teacher inputs, taken from batch fields of the same names")
    p.add_argument("--outputs", metavar="NAME[,NAME]", help="teacher outputs to store (default: all)")
    p.add_argument("--model", help="model name on the teachers (default: what each serves)")
    p.add_argument("--model-version", default="", help="model version to ask for (default: the teacher's)")
    add_transform_args(p)  # --top-k, --output-dtype, --logprobs, ...: declared once, with the reader's options
    p.add_argument("--prefetch", type=int, default=16, help="batches in flight (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline per request, seconds (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("loader_command", nargs=argparse.REMAINDER, metavar="-- python -m MODULE [ARGS...]",
                   help="a module whose loader() returns the loader, imported with sys.argv = [MODULE, *ARGS]")
    return p


def _transform_names() -> list[str]:
    return add_transform_args(argparse.ArgumentParser(add_help=False))


def add_record_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``record`` on the ``distill`` command's subparsers."""
    return add_record_arguments(subparsers.add_parser("record", help=_RECORD_HELP, description=_RECORD_DESCRIPTION))


def record(args: argparse.Namespace, out: Any = None, err: Any = None) -> int:
    """Run ``distill record`` (:func:`distill.cache.recording.record` on the loader the flags name).
    Returns the exit status: 1 with a message on stderr when the loader or the teachers fail."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    from distill.cache.recording import loader_from_callable, loader_from_module
    from distill.cache.recording import record as run_record
    from distill.errors import DistillError

    command = args.loader_command[1:] if args.loader_command[:1] == ["--"] else args.loader_command
    if bool(args.loader) == bool(command):
        print("distill record: name the loader once: --loader MODULE:FUNCTION, or -- python -m MODULE [ARGS...] "
              "at the end", file=err)
        return 2
    key: str | int = int(args.key) if args.key.lstrip("-").isdigit() else args.key
    _working_directory_first()
    try:
        loader = loader_from_callable(args.loader) if args.loader else loader_from_module(command)
        result = run_record(
            loader, cache=args.cache, teachers=args.teachers, registry=args.registry, service=args.service,
            inputs=args.inputs.split(","), outputs=args.outputs.split(",") if args.outputs else None, key=key,
            model=args.model, model_version=args.model_version, prefetch=args.prefetch, timeout=args.timeout,
            progress=not args.no_progress, progress_file=err,
            **{name: getattr(args, name) for name in _transform_names()})
    except (ValueError, TypeError, ImportError, AttributeError, DistillError) as e:
        print(f"distill record: {e}", file=err)
        return 1
    print(result.summary(args.cache), file=out)
    return 0


def _working_directory_first() -> None:
    """Import the loader's module from the working directory first, as `python -m` (and
    `teacher-server --model`) do: the `distill` script's own sys.path starts with its bin directory,
    so `--loader mymodule:loader` would otherwise need PYTHONPATH=. to find ./mymodule.py."""
    cwd = os.getcwd()
    if sys.path[:1] not in ([cwd], [""]):
        sys.path.insert(0, cwd)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache`` on the ``distill`` command's subparsers (what ``distill.cli`` calls)."""
    return add_arguments(subparsers.add_parser(
        "cache", help="look at a teacher-output store (distill cache info|verify PATH)",
        description="Tools for a store of teacher outputs (distill.cache).",
    ))


def run(args: argparse.Namespace, out: Any = None) -> int:
    """Run the parsed ``cache`` subcommand; returns the exit status."""
    out = out if out is not None else sys.stdout
    from distill.cache.errors import CacheError

    try:
        from distill.cache.store import TeacherOutputStore
    except ModuleNotFoundError as e:
        if e.name != "pyarrow":
            raise
        print("distill cache: needs pyarrow; install it with: pip install 'distill-mesh[cache]'", file=sys.stderr)
        return 1

    if args.cache_command == "record":
        return record(args, out)
    if args.cache_command not in ("info", "verify"):  # pragma: no cover - argparse rejects unknown commands
        return 2
    try:
        store = TeacherOutputStore.open(args.path, mode="r")
    except CacheError as e:  # StoreNotFoundError among them
        print(f"distill cache: {e}", file=sys.stderr)
        return 1
    if args.cache_command == "verify":
        with store:
            found = store.verify()
        print(json.dumps(found.to_dict(), indent=2) if args.json else found.render(), file=out)
        return 0 if found.ok else 1
    with store:
        removed = store.remove_torn() if args.remove_torn else []
        info = store.info()
    if args.json:
        doc = info.to_dict()
        doc["removed_torn"] = removed
        print(json.dumps(doc, indent=2), file=out)
    else:
        print(info.render(max_shards=args.max_shards), file=out)
        for name in removed:
            print(f"removed torn tmp/{name}", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``distill cache ...`` on its own (``python -m distill.cache.cli info PATH``)."""
    parser = add_arguments(argparse.ArgumentParser(prog="distill cache", description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
