"""The ``distill`` command: tools for people running a distillation mesh.

    distill top --registry etcd://10.0.0.5:2379 [--service NAME] [--interval 1] [--once]
    distill gateway --registry etcd://10.0.0.5:2379 --service NAME --port 8000   (distill.gateway)

Subcommands live in their own modules (``discovery.top``, an operator tool that reads only the
registry; ``distill.cache.cli``); this module only dispatches, so adding one does not touch the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from discovery import top
from distill import check_teachers, gateway_cli
from distill.cache import cli as cache_cli
from teacher_server.registrar import cli as registrar_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distill", description="Tools for a knowledge-distillation mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    top.add_arguments(sub.add_parser(
        "top", help="live view of teachers, students and the autoscaler, read from etcd",
        description="A live view of the mesh read from etcd, refreshing like top: per service, the teachers "
        "(endpoint, device, model, queue, in-flight, samples/s, busy, capacity), the students (samples/s, "
        "stall) and the autoscaler's records. --once prints one snapshot and exits (exit 1: registry unreachable).",
    ))
    cache_cli.add_parser(sub)
    cache_cli.add_record_parser(sub)
    gateway_cli.add_parser(sub)
    check_teachers.add_parser(sub)
    registrar_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "top":
        return top.run(args)
    if args.command == "cache":
        return cache_cli.run(args)
    if args.command == "record":
        return cache_cli.record(args)
    if args.command == "gateway":
        return gateway_cli.run(args)
    if args.command == "check-teachers":
        return check_teachers.run(args)
    if args.command == "register":
        return registrar_cli.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
