"""``distill check-teachers``: are the replicas of a service the same teacher?

    distill check-teachers --registry etcd://10.0.0.5:2379 --service NAME [--atol 1e-4]
    distill check-teachers --teachers host:port,host:port

Each live replica gets one probe: a fixed, deterministic batch built from the first replica's
declared inputs (two rows; token ids 1..7 for integer inputs, ones for an attention mask, a sine
for float inputs; a dimension of any length gets 8). Each replica's outputs are compared with those
of the reference replica (the first, by endpoint, of the fingerprint most replicas state): as
log-probabilities by default (``--values logprobs``, what a student learns from; ``raw`` for a
server without output transforms, such as Triton). The table names each replica's endpoint,
fingerprint and largest absolute difference; the exit status is 1 when replicas state different
fingerprints, differ beyond ``--atol`` or fail the probe, 2 when none can be probed (or the flags
are wrong), 0 when all agree.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from discovery import open_registry
from discovery.aio import bounded
from discovery.errors import RegistryError
from distill.checks import registry_address, service_name, teacher_list

if TYPE_CHECKING:  # imported where used: the `distill` command's other subcommands (`distill register`) need no torch
    import torch

    from distill.types import FieldArray, TeacherMetadata

__all__ = ["Replica", "add_parser", "check", "probe_inputs", "run"]

PROBE_ROWS = 2
PROBE_LENGTH = 8  # positions given to a dimension of any length (-1)
_CLOSE_TIMEOUT_S = 5.0


class ProbeError(ValueError):
    """No probe can be built for the teacher's declared inputs; the message says which and why."""


@dataclass
class Replica:
    """One replica's answer to the probe: its fingerprint and its difference from the reference."""

    endpoint: str
    fingerprint: str = ""
    outputs: dict[str, torch.Tensor] | None = None
    error: str = ""
    diff: float | None = None  # largest absolute difference from the reference; inf: shapes differ
    reference: bool = False

    def problems(self, fingerprint: str, atol: float) -> list[str]:
        """What is wrong with this replica against the reference `fingerprint` and tolerance."""
        if self.error:
            return [f"probe failed: {self.error}"]
        found = []
        if self.fingerprint != fingerprint:
            found.append("other fingerprint")
        if self.diff is not None and not self.diff <= atol:
            found.append(f"outputs differ by more than {atol:g}")
        return found


def probe_inputs(meta: TeacherMetadata) -> dict[str, FieldArray]:
    """The fixed probe batch for `meta`'s declared inputs (the same on every run and machine)."""
    import numpy as np
    import torch

    from distill.types import FieldArray
    from protos.kserve import DATATYPES
    from protos.text import OPTIONAL_INPUTS

    fields = {}
    for name, t in meta.inputs.items():
        if name in OPTIONAL_INPUTS:  # text and vocabulary requests: sent instead of the ids, never beside them
            continue
        shape = (PROBE_ROWS, *(PROBE_LENGTH if d < 0 else d for d in t.shape))
        n = math.prod(shape)
        dt = DATATYPES.get(t.datatype)
        if dt is None or t.datatype == "BOOL":
            raise ProbeError(f"input {name!r} is {t.datatype}: check-teachers probes numeric inputs only")
        if dt.torch_dtype.is_floating_point:
            values = torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + 0.1).to(dt.torch_dtype)
            array = (values.view(torch.int16) if dt.torch_dtype is torch.bfloat16 else values).numpy()
        elif "MASK" in name.upper():
            array = np.ones(n, dtype=dt.numpy_dtype)
        else:
            array = (np.arange(n) % 7 + 1).astype(dt.numpy_dtype)  # small ids: valid in any vocabulary
        fields[name] = FieldArray(np.ascontiguousarray(array.reshape(shape)), t.datatype)
    return fields


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            return math.inf
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


async def _probe(replica: Replica, meta: TeacherMetadata, logprobs: bool, timeout: float) -> None:
    from distill.call_errors import TeacherCallError, TeacherGoneError
    from distill.teacher_client import TeacherClient
    from distill.types import ChunkRequest

    client = TeacherClient(replica.endpoint)
    try:
        own = await client.fetch_metadata(meta.model_name, "", timeout)
        replica.fingerprint = own.fingerprint or replica.fingerprint
        request = ChunkRequest(own.model_name, own.model_version, "check-teachers", probe_inputs(meta), 0, PROBE_ROWS,
                               tuple(sorted(own.outputs)), own.outputs, {"logprobs": True} if logprobs else None)
        replica.outputs = await client.infer(request, timeout)
    except (TeacherCallError, TeacherGoneError, ProbeError, ValueError) as e:
        replica.error = str(e) or type(e).__name__
    finally:
        with contextlib.suppress(Exception):
            await bounded(client.close(), _CLOSE_TIMEOUT_S)


async def check(endpoints: dict[str, str], *, model: str | None = None, logprobs: bool = True,
                timeout: float = 10.0) -> list[Replica]:
    """Probe every endpoint (endpoint -> the fingerprint its record states, "" if none) at once and
    compare; the replicas in endpoint order, the reference marked. ProbeError when no replica
    answers its metadata, or its inputs cannot be probed."""
    from distill.call_errors import TeacherCallError, TeacherGoneError
    from distill.teacher_client import TeacherClient

    replicas = [Replica(e, fp) for e, fp in sorted(endpoints.items())]
    meta = None
    for r in replicas:
        client = TeacherClient(r.endpoint)
        try:
            meta = await client.fetch_metadata(model, "", timeout)
            break
        except (TeacherCallError, TeacherGoneError, ValueError) as e:
            r.error = str(e)
        finally:
            with contextlib.suppress(Exception):
                await bounded(client.close(), _CLOSE_TIMEOUT_S)
    if meta is None:
        raise ProbeError("no replica answered its model metadata: "
                         + "; ".join(f"{r.endpoint}: {r.error}" for r in replicas))
    probe_inputs(meta)  # a ProbeError here concerns every replica
    await asyncio.gather(*(_probe(r, meta, logprobs, timeout) for r in replicas))
    answered = [r for r in replicas if r.outputs is not None]
    if answered:
        common = collections.Counter(r.fingerprint for r in answered).most_common(1)[0][0]
        ref = next(r for r in answered if r.fingerprint == common)
        ref.reference = True
        assert ref.outputs is not None
        for r in answered:
            assert r.outputs is not None
            r.diff = _largest_difference(ref.outputs, r.outputs)
    return replicas


def report(replicas: list[Replica], atol: float, out: TextIO) -> int:
    """Print the table; the exit status (0: all agree, 1: they do not, 2: none answered the probe)."""
    ref = next((r for r in replicas if r.reference), None)
    rows = [["ENDPOINT", "FINGERPRINT", "MAX ABS DIFF", "VERDICT"]]
    bad = 0
    for r in replicas:
        problems = r.problems(ref.fingerprint if ref else "", atol)
        bad += bool(problems)
        diff = "-" if r.diff is None else "inf (shapes differ)" if math.isinf(r.diff) else f"{r.diff:.3g}"
        verdict = "; ".join(problems) or ("reference" if r.reference else "same")
        rows.append([r.endpoint, r.fingerprint or "(none)", diff, verdict.upper() if problems else verdict])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[3] + "\n")
    if ref is None:
        out.write("no replica answered the probe\n")
        return 2
    out.write(f"{len(replicas) - bad} of {len(replicas)} replica(s) agree with {ref.endpoint} "
              f"(fingerprint {ref.fingerprint or '(none)'}, atol {atol:g})\n")
    return 1 if bad else 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Mount ``check-teachers`` on the ``distill`` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "check-teachers", help="probe every replica of a service and compare their fingerprints and outputs",
        description="Send one fixed probe to every live replica of a service and print, per replica, its "
        "fingerprint and the largest absolute difference of its outputs (log-probabilities) from the replica "
        "most of them agree with. Exit 1 when fingerprints differ or outputs differ beyond --atol.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--registry", type=registry_address, metavar="etcd://HOST:PORT[,HOST:PORT]",
                       help="etcd where the teachers register (with --service)")
    where.add_argument("--teachers", type=teacher_list, metavar="HOST:PORT[,HOST:PORT]",
                       help="the replicas' addresses, instead of a registry")
    p.add_argument("--service", type=service_name, metavar="NAME", help="the service whose replicas to check")
    p.add_argument("--model", metavar="NAME", help="the model to probe (default: the one each teacher serves)")
    p.add_argument("--atol", type=float, default=1e-4,
                   help="largest absolute difference of outputs taken as the same (default: %(default)g)")
    p.add_argument("--values", choices=("logprobs", "raw"), default="logprobs",
                   help="compare log-probabilities (default), or the raw outputs for a server without output "
                   "transforms (Triton)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for each call (default: %(default)g)")
    return p


async def _endpoints(args: argparse.Namespace) -> dict[str, str]:
    if args.teachers:
        return dict.fromkeys((e.strip() for e in args.teachers.split(",") if e.strip()), "")
    registry = open_registry(args.registry, timeout=args.timeout)
    try:
        found = await registry.teachers(args.service)
    finally:
        with contextlib.suppress(Exception):
            await bounded(registry.close(), _CLOSE_TIMEOUT_S)
    return {entry.endpoint: entry.record.fingerprint for entry in found.values()}


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``distill check-teachers`` with parsed flags; returns the exit status."""
    stream = out if out is not None else sys.stdout
    if args.registry and not args.service:
        print("distill check-teachers: --registry needs --service NAME", file=sys.stderr)
        return 2
    if not args.atol >= 0 or not args.timeout > 0:
        print("distill check-teachers: --atol must be >= 0 and --timeout > 0", file=sys.stderr)
        return 2

    async def main() -> int:
        endpoints = await _endpoints(args)
        if not endpoints:
            print(f"distill check-teachers: no live teacher in service {args.service!r}", file=sys.stderr)
            return 2
        replicas = await check(endpoints, model=args.model, logprobs=args.values == "logprobs",
                               timeout=args.timeout)
        return report(replicas, args.atol, stream)

    try:
        return asyncio.run(main())
    except (ProbeError, RegistryError) as e:
        print(f"distill check-teachers: {e}", file=sys.stderr)
        return 2
