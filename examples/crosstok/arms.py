"""The example's arms: one student run each, on the same pieces in the same order, scored by bits per byte.

* ``no_kd``: the student with its own tokenizer, next-token cross-entropy on the pieces.
* ``crosstok_kd``: the same student, the same initial weights, distilled from a teacher with
  another tokenizer through the mesh: ``DistillReader(..., inputs=["TEXT"])`` sends each batch's
  texts, the teacher server scores them in its own tokens, and ``examples.crosstok.kd`` aligns the
  answer to the student's tokens by bytes and applies ``distill.crosstok``'s GOLD and ULD losses.
* ``same_tokenizer_reference``: the same architecture with the *teacher's* tokenizer, distilled
  from the same server with the existing same-tokenizer token KD (``INPUT_IDS`` in,
  top-k log-probabilities out, ``distill.losses.TokenKDLoss``): what the cross-tokenizer arm
  would reach if the tokenizers matched.
* ``crosstok_onpolicy``: the ``crosstok_kd`` arm for the first part of the steps, then on-policy:
  the student samples continuations of the batch's piece prefixes, the same teacher scores the
  samples as text through the same mesh, and the student learns from them beside the batch's hard
  labels (``examples.crosstok.onpolicy``).

Every KD arm asks the server for the same top-k log-probabilities with the tail at the same
temperature, and weighs the hard-label cross-entropy by the same ``alpha``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerFast

from distill import DistillReader
from distill.losses import TokenKDLoss
from examples.common import seed_everything
from examples.crosstok import kd
from examples.crosstok.corpus import TextCollator, batches, plan
from examples.crosstok.mesh import OUTPUT, Mesh, topk_options
from examples.crosstok.onpolicy import OnPolicyKD, OnPolicySettings
from examples.crosstok.train import Batch, LossFn, bits_per_byte, fit, next_token_ce
from examples.llm import models
from examples.llm.mesh import INPUTS
from examples.llm.student import kd_loss, targets_from_outputs

ARMS = ("no_kd", "crosstok_kd", "crosstok_onpolicy", "same_tokenizer_reference")


@dataclass(frozen=True)
class Setup:
    """What every arm of a run shares: the tokenizers, the pieces, the sizes and the KD settings."""

    student_tokenizer: PreTrainedTokenizerFast
    teacher_tokenizer: PreTrainedTokenizerFast
    train: Sequence[str]
    held_out: Sequence[str]
    role: str  # the student's size in examples.llm.models
    max_len: int
    steps: int
    batch_size: int
    lr: float
    k: int
    temperature: float
    alpha: float
    mesh: Mesh | None  # where the teacher is (None: no KD arm runs)
    timeout: float = 60.0
    onpolicy: OnPolicySettings = field(default_factory=OnPolicySettings)  # the crosstok_onpolicy arm's settings


def run(arm: str, seed: int, setup: Setup) -> dict[str, Any]:
    """One arm at one seed: the student trained from the seed's initialisation on the seed's batches,
    then its held-out bits per byte; a plain dict for the results JSON."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
    tokenizer = setup.teacher_tokenizer if arm == "same_tokenizer_reference" else setup.student_tokenizer
    seed_everything(seed)
    student = models.build(setup.role, len(tokenizer), max_len=setup.max_len, pad_token_id=int(tokenizer.pad_token_id),
                           eos_token_id=int(tokenizer.eos_token_id))
    order = plan(len(setup.train), batch_size=setup.batch_size, steps=setup.steps, seed=seed)
    loader = list(batches(setup.train, TextCollator(tokenizer, setup.max_len), order))
    started = time.perf_counter()
    taught = [0]
    extra: dict[str, Any] = {}
    with _source(arm, setup, loader, student, seed=seed, extra=extra) as (pairs, loss_fn):
        losses, seconds = fit(student, _counted(pairs, taught), loss_fn, steps=setup.steps, lr=setup.lr)
    metric = bits_per_byte(student, tokenizer, setup.held_out, max_len=setup.max_len)
    return {"arm": arm, "seed": seed, **asdict(metric), "vocab_size": len(tokenizer),
            "parameters": models.parameter_count(student), "first_loss": losses[0], "last_loss": losses[-1],
            "teacher_steps": taught[0], **{k: v() for k, v in extra.items()}, "train_seconds": round(seconds, 1),
            "seconds": round(time.perf_counter() - started, 1)}


def _counted(pairs: Iterable[tuple[Batch, Any]], taught: list[int]) -> Iterator[tuple[Batch, Any]]:
    """``pairs`` unchanged, counting in ``taught[0]`` the steps that had teacher outputs (a reader
    yields None for a batch no teacher answered, which then trains on its hard labels alone)."""
    for batch, outputs in pairs:
        taught[0] += outputs is not None
        yield batch, outputs


@contextlib.contextmanager
def _source(arm: str, setup: Setup, loader: list[Batch], student: Any, *, seed: int,
            extra: dict[str, Any]) -> Iterator[tuple[Any, LossFn]]:
    """The arm's ``(batch, teacher outputs)`` pairs over ``loader`` and its loss; an arm with figures
    of its own for the results puts a function returning them in ``extra``."""
    if arm == "no_kd":
        yield ((b, None) for b in loader), next_token_ce
        return
    if setup.mesh is None:
        raise ValueError(f"the {arm} arm needs the teacher: run it with a Setup whose mesh is served")
    if arm == "same_tokenizer_reference":
        token_kd = TokenKDLoss(temperature=setup.temperature, alpha=setup.alpha)
        options = {**setup.mesh.reader_location(), "inputs": INPUTS, "outputs": [OUTPUT],
                   **topk_options(k=setup.k, temperature=setup.temperature), "timeout": setup.timeout}

        def reference_loss(logits: Any, batch: Batch, outputs: Any) -> Any:
            return kd_loss(token_kd, logits, targets_from_outputs(outputs), batch)

        with DistillReader(loader, **options) as reader:
            yield iter(reader), reference_loss
        return
    crosstok = kd.CrossTokenizerKD(setup.student_tokenizer, setup.mesh, k=setup.k,
                                   temperature=setup.temperature, alpha=setup.alpha, timeout=setup.timeout)
    if arm == "crosstok_onpolicy":
        onpolicy = OnPolicyKD(student, crosstok, setup.student_tokenizer, setup.onpolicy, seed=seed)
        extra["onpolicy"] = lambda: {**asdict(setup.onpolicy), **onpolicy.counts.summary()}
        with onpolicy.pairs(loader) as pairs:
            yield pairs, onpolicy.loss
        return
    with DistillReader(crosstok.prepare(loader), **crosstok.reader_options()) as reader:
        yield iter(reader), crosstok.loss
