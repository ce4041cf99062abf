"""``distill cache``: look at a teacher-output store.

    distill cache info PATH            # namespace, samples, bytes per sample and per token, shards
    distill cache info PATH --json     # the same as JSON, for scripts
    distill cache info PATH --remove-torn   # also delete shards torn by writers that died on this host

This module imports pyarrow and torch only when a subcommand runs, so ``distill --help`` and
``distill top`` stay fast and work without the ``cache`` extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "add_parser", "main", "run"]


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
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache`` on the ``distill`` command's subparsers (what ``distill.cli`` calls)."""
    return add_arguments(subparsers.add_parser(
        "cache", help="look at a teacher-output store (distill cache info PATH)",
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

    if args.cache_command != "info":  # pragma: no cover - argparse rejects unknown commands
        return 2
    try:
        store = TeacherOutputStore.open(args.path, mode="r")
    except CacheError as e:  # StoreNotFoundError among them
        print(f"distill cache: {e}", file=sys.stderr)
        return 1
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
