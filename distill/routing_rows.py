"""A routed batch on the engine's side (``route_by``, see ``distill.routing_keys``): one job per
service for that service's rows, each going through the service's pool exactly as a whole batch
does (its queue, hedging, failover, exactly-once), and the answers put back in row order as ONE
dict of outputs when the last service's rows are in.

A batch whose rows all go to one service is sent as it is (no copy, no merge). A service's refusal,
a timeout or rows of inf or NaN fail the whole batch (`BatchRejectedError` in its place); with
``fallback="hard_labels"`` a service that cannot answer its rows turns the whole batch to hard
labels (None outputs), since a batch with soft targets on some rows only would weigh its rows
unevenly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from distill.batches import Chunk, Delivery, Job
from distill.cache.reader_side import batch_keys, fit_width
from distill.errors import BatchRejectedError, RoutedOutputsMismatchError
from distill.options import ReaderOptions
from distill.outputs import VALID_ROWS, base_output, default_outputs, per_sample_shape, wanted_outputs
from distill.routing_keys import RoutePlan, RouteTable
from distill.stats import RoutedRows
from distill.types import FieldArray, OutputCache, StoredRows, TeacherMetadata
from protos.text import TEXT

__all__ = ["RoutedBatch", "check_routed_outputs", "offer_routed", "route_job", "routed_rows_to_send"]

MERGED = ""  # the key of a merged batch's one dict of outputs in `Job.outputs`


def route_job(job: Job, plan: RoutePlan) -> list[Job]:
    """The jobs that carry `job`'s rows, one per service that has rows (`Job.remaining` names it):
    the batch itself when all its rows go to one service, else a job per service, the batch waiting
    for them all."""
    groups = plan.groups
    if len(groups) == 1:
        job.remaining = {groups[0].service: job.sent}
        return [job]
    routed = RoutedBatch(job, plan)
    job.routed = routed
    job.remaining = {g.service: g.size for g in groups}
    return list(routed.parts.values())


def routed_rows_to_send(routes: RouteTable, batch: Any, size: int, fields: dict[str, FieldArray], *,
                        cache: OutputCache | None, key: str | int | None
                        ) -> tuple[dict[str, FieldArray], StoredRows | None, RoutePlan | BatchRejectedError | None]:
    """What of a loader's batch goes to which teacher (on the loader thread): the inputs to send
    (a store's misses), what the store held, and the plan; a `RouteKeyError` in the plan's place
    when rows name no teacher (the batch is refused in its place), None when nothing is sent. With
    a store, each routed row is looked up and stored under its teacher (`RouteTable.store_keys`)."""
    try:
        which = routes.which(batch, size)
    except BatchRejectedError as e:
        return fields, None, e
    cached = None
    if cache is not None:
        looked = batch if key is None else _with_keys(batch, key, routes.store_keys(batch_keys(batch, key), which))
        fields, cached = cache.rows_to_send(looked, size, fields)
        if cached.all_hit:
            return fields, cached, None
        which = which[cached.miss_indices]
    return fields, cached, routes.plan(which, fields)


def _with_keys(batch: Any, key: str | int, keys: Any) -> Any:
    """`batch` with its field `key` replaced, as the store reads it."""
    if isinstance(batch, Mapping):
        return {**batch, key: keys}
    assert isinstance(key, int)
    return tuple(keys if i == key % len(batch) else v for i, v in enumerate(batch))


def offer_routed(jobs: list[Job], plans: list[RoutePlan | None], counter: RoutedRows, delivery: Delivery,
                 offer: Mapping[str, Callable[[list[Chunk]], None]]) -> None:
    """New batches (in order) to the dispatchers (`offer`, per service), each service its rows of
    each batch, all of a service's at once; a batch without a plan was refused (its error is set).
    The batches' rows and tokens are counted once for them all (one event of the demand's window)."""
    chunks: dict[str, list[Chunk]] = {s: [] for s in offer}
    counts = {s: [0, 0] for s in offer}
    for job, plan in zip(jobs, plans, strict=True):
        if plan is None:
            delivery.maybe_complete(job)
            continue
        for g in plan.groups:
            counted = counts[g.service]
            counted[0] += g.size
            counted[1] += g.tokens
        for part in route_job(job, plan):
            service = next(iter(part.remaining))
            chunks[service].append(Chunk(part, service, 0, part.sent))
    if any(rows for rows, _ in counts.values()):
        counter.add({s: (rows, tokens) for s, (rows, tokens) in counts.items() if rows})
    for service, mine in chunks.items():
        if mine:
            offer[service](mine)


class RoutedBatch:
    """A batch whose rows go to several services: its part per service, and the merge. Both run on
    the engine's thread for every routed batch, so they do per batch only what they must: the
    parts share the batch's signature, and the merge scatters with numpy (less work per call than
    torch's indexing at these sizes), torch only for what numpy cannot hold (bfloat16)."""

    def __init__(self, batch: Job, plan: RoutePlan) -> None:
        self.batch = batch
        self.rows = {g.service: g.rows for g in plan.groups}  # each part's positions among the rows sent
        self.parts: dict[str, Job] = {}
        for g in plan.groups:
            # A part's inputs are rows of the batch's: the same names, datatypes and sample shapes.
            part = Job(batch.epoch, batch.seq, None, g.size, g.fields, batch.signature,
                       parameters=batch.parameters, routed=self)
            part.remaining = {g.service: g.size}
            self.parts[g.service] = part

    def part_done(self, part: Job, delivery: Delivery) -> None:
        """A service's rows are answered (or failed): into the batch; its first error fails it, and the
        parts still out are then dropped by their dispatchers."""
        batch = self.batch
        if batch.delivered:
            return
        service = next(iter(part.remaining))
        if part.error is not None and batch.error is None:
            batch.error = part.error
        batch.outputs[service] = part.outputs.get(service)
        batch.remaining[service] = 0
        if batch.error is not None:
            self.fail(batch.error)
        delivery.maybe_complete(batch)

    def fail(self, error: BaseException) -> None:
        """The batch failed (a part's error, its deadline): nothing more is wanted of any part."""
        self.batch.remaining = dict.fromkeys(self.batch.remaining, 0)
        for part in self.parts.values():
            if part.error is None and not part.delivered:
                part.error = error

    def merge(self) -> None:
        """Every service answered: `Job.outputs` becomes one dict, each row in its place in the batch
        (a store's stored rows in theirs), per-position outputs at the batch's own padded width."""
        batch = self.batch
        if batch.error is not None:
            return
        answers = [batch.outputs.get(service) for service in self.parts]
        if any(a is None for a in answers):
            batch.outputs = {MERGED: None}  # hard labels for the whole batch
            return
        cached = batch.cached
        miss = cached.miss_indices if cached is not None and len(cached.miss_indices) != batch.size else None
        # Where each part's rows go in the batch: its positions among the rows sent, which with a
        # store's partial hit are the missing rows.
        parts = [(self.rows[s] if miss is None else miss[self.rows[s]], a)
                 for s, a in zip(self.parts, answers, strict=True) if a is not None]
        names = [n for n in parts[0][1] if n != VALID_ROWS]
        merged: dict[str, torch.Tensor] = {}
        try:
            for name in names:
                merged[name] = self._merge_one(name, parts, miss is not None)
        except KeyError as e:
            batch.error = BatchRejectedError(
                f"batch {batch.seq}: the services answered different outputs ({e} is missing from one); the "
                "teachers changed since the reader started: restart it, or route to teachers of the same outputs")
            return
        if any(VALID_ROWS in a for _, a in parts):
            mask = np.ones(batch.size, dtype=bool)
            for rows, a in parts:
                if (valid := a.get(VALID_ROWS)) is not None:
                    mask[rows] = valid.numpy()
            merged[VALID_ROWS] = torch.from_numpy(mask)
        batch.outputs = {MERGED: merged}

    def _width(self) -> int | None:
        """The batch's padded width: the second dimension its sequence inputs share (None: none, or
        they differ)."""
        widths = {f.array.shape[1] for f in self.batch.fields.values() if f.array.ndim >= 2}
        return widths.pop() if len(widths) == 1 else None

    def _merge_one(self, name: str, parts: list[tuple[np.ndarray, dict[str, torch.Tensor]]], stored: bool
                   ) -> torch.Tensor:
        values = [a[name] for _, a in parts]
        first = values[0]
        if first.ndim >= 2 and any(v.shape[1:] != first.shape[1:] for v in values):
            width = self._width() or max(v.shape[1] for v in values)
            values = [fit_width(v, width) for v in values]  # padded rows: each group at its own width
        batch = self.batch
        shape = (batch.size, *values[0].shape[1:])
        if first.dtype is torch.bfloat16:  # numpy has no bfloat16
            out = torch.empty(shape, dtype=first.dtype)
            for (rows, _), value in zip(parts, values, strict=True):
                out[torch.from_numpy(rows)] = value.to(first.dtype)
        else:
            buf = np.empty(shape, dtype=first.numpy().dtype)
            for (rows, _), value in zip(parts, values, strict=True):
                buf[rows] = (value if value.dtype is first.dtype else value.to(first.dtype)).numpy()
            out = torch.from_numpy(buf)
        if stored and batch.cached is not None:
            out[torch.from_numpy(batch.cached.hit_indices)] = batch.cached.fit(name, values[0])
        return out


def _answer_layout(opts: ReaderOptions, meta: TeacherMetadata) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """The outputs a teacher answers this reader: name -> (datatype, per-sample shape), after the
    reader's transforms (top-k, token log-probs, output dtype)."""
    params = opts.request_parameters
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    text = TEXT in opts.inputs
    for name in wanted_outputs(tuple(opts.outputs or default_outputs(meta.outputs, text)), params,
                               inputs=tuple(opts.inputs)):
        base = meta.outputs.get(base_output(name))
        datatype = "?" if base is None else base.datatype
        if opts.output_dtype and datatype in ("FP32", "FP16", "BF16", "FP64"):
            datatype = opts.output_dtype
        out[name] = (datatype, per_sample_shape(name, meta.outputs, params))
    return out


def check_routed_outputs(opts: ReaderOptions, metas: Mapping[str, TeacherMetadata]) -> None:
    """Refuse, naming the first difference, services whose answers could not share one dict of outputs."""
    layouts = {s: _answer_layout(opts, m) for s, m in metas.items()}
    if len(layouts) < 2:
        return
    (first, want), *others = layouts.items()
    for service, got in others:
        if got.keys() != want.keys():
            raise RoutedOutputsMismatchError(
                f"route_by: service {service!r} answers outputs {sorted(got)} but {first!r} answers {sorted(want)}; "
                "the rows of a batch come back as one dict, so every routed service must answer the same outputs: "
                "pass outputs= naming the ones they share, or route to teachers of the same model family")
        for name, (datatype, shape) in want.items():
            other_dt, other_shape = got[name]
            padded = shape is not None and other_shape is not None and len(shape) == len(other_shape) and all(
                a == b or -1 in (a, b) for a, b in zip(shape, other_shape, strict=True))
            if datatype != other_dt or not (shape == other_shape or padded):
                raise RoutedOutputsMismatchError(
                    f"route_by: output {name!r} is {other_dt} {list(other_shape or ())} per sample from service "
                    f"{service!r} but {datatype} {list(shape or ())} from {first!r}; the rows of a batch come back "
                    "as one tensor per output, so the routed services must agree: pass output_dtype= / top_k= to "
                    "make them agree, or route to teachers of the same model family")

