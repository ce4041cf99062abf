"""``python -m discovery``: look at a registry, or register a stand-in teacher.

Why: when students see no teachers, the first question is "what is in etcd?"; ``show`` answers it
without etcdctl and without knowing the key layout. ``register`` announces a record for a teacher
that is not a ``teacher-server`` (or a stand-in for crash tests) and holds it until killed.

    python -m discovery show     --registry etcd://127.0.0.1:2379 --service svc
    python -m discovery watch    --registry etcd://127.0.0.1:2379 --service svc
    python -m discovery register --registry etcd://127.0.0.1:2379 --service svc \\
        --instance-id t1 --endpoint 127.0.0.1:9898 --ttl 10
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence

from discovery import open_registry
from discovery.base import Registry, RegistryError, TeacherSet
from discovery.signals import StopSignals
from protos import registry_pb2


def _print_set(snapshot: TeacherSet) -> None:
    print(f"revision {snapshot.revision}: {len(snapshot)} teacher(s)", flush=True)
    for iid in sorted(snapshot):
        e = snapshot[iid]
        load = e.load
        extra = (
            f" queue={load.queue_depth} in_flight={load.in_flight} samples/s={load.samples_per_s:.0f}"
            f" busy={load.busy_fraction:.2f}{' draining' if load.draining else ''}"
            if load is not None
            else ""
        )
        print(f"  {iid}  {e.endpoint}  {e.record.model_name}{extra}", flush=True)


async def _show(registry: Registry, service: str) -> None:
    _print_set(await registry.teachers(service))
    for d in await registry.demand(service):
        print(
            f"  student {d.student_id}: samples/s={d.samples_per_s:.0f} wait={d.wait_fraction:.2f} "
            f"in_flight={d.in_flight} teachers={d.teachers_in_use}",
            flush=True,
        )


async def _watch(registry: Registry, service: str) -> None:
    async with registry.watch(service) as watch:
        async for snapshot in watch:
            _print_set(snapshot)


async def _register(registry: Registry, args: argparse.Namespace, stop: StopSignals) -> None:
    record = registry_pb2.TeacherRecord(
        instance_id=args.instance_id,
        endpoint=args.endpoint,
        model_name=args.model_name,
        started_at=time.time(),
    )
    def load() -> registry_pb2.TeacherLoad:
        return registry_pb2.TeacherLoad(instance_id=args.instance_id, updated_at=time.time())

    async with registry.register(args.service, record, ttl=args.ttl, load=load) as reg:
        if await reg.wait_registered(timeout=30.0):
            print(f"registered {reg.key} lease={reg.lease_id:x}", flush=True)
        await stop.wait()  # then leave the block: the registration is withdrawn at once


async def _amain(args: argparse.Namespace) -> int:
    # SIGTERM/SIGINT end every command with exit 0: `register` waits for them and withdraws its
    # record; `show` and `watch` are cancelled wherever they wait.
    main = asyncio.current_task()
    assert main is not None
    with StopSignals(cancel=None if args.command == "register" else main) as stop:
        try:
            async with open_registry(args.registry) as registry:
                if args.command == "show":
                    await _show(registry, args.service)
                elif args.command == "watch":
                    await _watch(registry, args.service)
                else:
                    await _register(registry, args, stop)
        except asyncio.CancelledError:
            if not stop.stopped:
                raise
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m discovery", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("show", "print the teachers, their loads and the students' demand once"),
        ("watch", "print every teacher-set snapshot as it changes"),
        ("register", "register a teacher record and hold it until SIGTERM/SIGINT (exit 0)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--registry", required=True, metavar="etcd://HOST:PORT[,HOST:PORT]")
        p.add_argument("--service", required=True)
        if name == "register":
            p.add_argument("--instance-id", required=True)
            p.add_argument("--endpoint", required=True, metavar="HOST:PORT")
            p.add_argument("--model-name", default="")
            p.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr)
    try:
        return asyncio.run(_amain(args))
    except KeyboardInterrupt:
        return 130
    except (RegistryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
