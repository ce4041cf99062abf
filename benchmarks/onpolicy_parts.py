"""The parts of W7 (benchmarks/onpolicy.py): the models, one on-policy step and its two loops.

An on-policy distillation step: the student samples continuations of a batch of prompts with its
current weights (`generate`), the teacher scores the tokens the student chose (the per-token
log-probability ``log p(x[t+1] | x[<=t])``), and the student takes one optimizer step on the
sampled-token policy-gradient loss (`distill.losses.sampled_token_pg_loss`, the reverse KL in
expectation). The two loops run the same steps over the same prompts:

  * `Loop.inprocess`: the teacher in this process, scored synchronously after each generation
    (staleness 0), as plain PyTorch does it best: `torch.inference_mode`, weights in the compute
    dtype on the student's device, the next-token gather and a logsumexp on the logits;
  * `Loop.mesh`: the teacher behind a `teacher-server`, through ``DistillReader(None).submit``
    with ``token_logprobs=True``, pipelined with staleness 1: step n's batch is submitted, step
    n+1's is generated while the teacher scores step n, then step n trains on its scores.

The teacher is the LLM example's (`benchmarks.llm_parts.prepare`: the cache's trained teacher,
the smoke one with --tiny, or --teacher DIR, with held-out prompts) or, with --shape, a model of
a published shape with random weights and random prompts (`SHAPES`): throughput does not depend
on the weights, and it lets a GPU run use a real size with nothing to download.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu import CpuMeter, CpuUsage
from benchmarks.device import DeviceChoice
from benchmarks.shapes import SHAPES as PUBLISHED

TOKENS_OUT = "LOGITS_TOKEN_LOGPROBS"

# (teacher, student) Qwen2 shapes with random weights; the student shares the teacher's vocabulary.
# The Qwen2.5 teachers are benchmarks.shapes' published configurations; the students are smaller.
_CONTEXT = {"max_position_embeddings": 4096}
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256),
             dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64)),
    "qwen2.5-0.5b": (PUBLISHED["qwen2.5-0.5b"] | _CONTEXT,
                     dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          intermediate_size=1408)),
    "qwen2.5-1.5b": (PUBLISHED["qwen2.5-1.5b"] | _CONTEXT,
                     dict(hidden_size=896, num_hidden_layers=6, num_attention_heads=14, num_key_value_heads=2,
                          intermediate_size=4864)),
}


def parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass
class Models:
    """The teacher (its directory for the server, and in this process), the fresh student, the prompts."""

    directory: Path
    vocab: int
    context: int
    pad_id: int
    prompts: torch.Tensor  # [n, prompt_len] int64, on the device
    teacher: torch.nn.Module
    student: torch.nn.Module
    source: str


def _qwen2(cfg: dict[str, Any], pad_id: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**cfg, pad_token_id=pad_id, bos_token_id=None, eos_token_id=None))


@contextlib.contextmanager
def models(*, shape: str, teacher: str, tiny: bool, prompts: int, prompt_len: int, seed: int, threads: int,
           choice: DeviceChoice) -> Iterator[Models]:
    """The models for one run (a --shape teacher lives in a temporary directory until the end)."""
    from benchmarks import llm_parts

    if not shape:
        ls = llm_parts.Settings(sequences=prompts, min_len=prompt_len, seed=seed, teacher=teacher, tiny=tiny,
                                instances=1, threads=threads, device=choice.device, compute_dtype=choice.compute_dtype)
        w = llm_parts.prepare(ls)
        from examples.llm import models as example

        torch.manual_seed(seed)
        role = "student-smoke" if w.vocab < 1024 else "student"
        student = example.build(role, w.vocab, max_len=w.max_len, pad_token_id=w.pad_id)
        torch.nn.Module.to(student, choice.torch_device)  # in place (the typed PreTrainedModel.to trips mypy)
        cut = torch.tensor([q[:prompt_len] for q in w.seqs], dtype=torch.long)
        yield Models(w.directory, w.vocab, w.max_len, w.pad_id, cut.to(choice.torch_device), w.model, student,
                     f"the LLM example's teacher, student role {role!r}")
        return
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: use one of {', '.join(SHAPES)}")
    teacher_cfg, student_cfg = SHAPES[shape]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving and loading a temporary model is no news
    torch.set_num_threads(threads or torch.get_num_threads())
    choice.check()
    with tempfile.TemporaryDirectory(prefix=f"w7-{shape}-") as tmp:
        directory = Path(tmp)
        torch.manual_seed(seed)
        shared = {k: teacher_cfg[k] for k in ("vocab_size", "tie_word_embeddings", "max_position_embeddings")}
        with torch.device(choice.torch_device):  # random init where the compute is (seconds for 1.5B on a GPU)
            model = _qwen2(teacher_cfg, 0)
            student = _qwen2(student_cfg | shared, 0)
        torch.nn.Module.to(model, choice.dtype)
        model.save_pretrained(str(directory))
        del model
        vocab, context = int(teacher_cfg["vocab_size"]), int(teacher_cfg["max_position_embeddings"])
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, vocab, (prompts, prompt_len), generator=g)
        print(f"teacher: random weights of shape {shape} in {directory}; student {parameters(student):,} "
              f"parameters; {prompts} random prompts of {prompt_len} tokens", flush=True)
        yield Models(directory, vocab, context, 0, ids.to(choice.torch_device),
                     llm_parts.load_inprocess(directory, choice), student, f"random weights, shape {shape}")


@torch.inference_mode()
def score_inprocess(teacher: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``log p(x[t+1] | x[<=t])`` per position ``[B, T]`` (0 at the last), as the server's
    token_logprobs: one forward pass, the next-token logit less the logsumexp, in fp32."""
    z = teacher(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, :-1].float()
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    out[:, :-1] = z.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return out


@dataclass
class StepTimes:
    """One loop of `steps` on-policy steps; phase times are summed over the steps."""

    steps: int
    seconds: float
    generate_s: float
    score_s: float  # in-process: scoring; mesh: waiting for the teacher's answer (what scoring costs the loop)
    train_s: float
    scored_tokens: int  # the completion tokens the student chose, scored and trained on
    teacher_positions: int  # positions the teacher computed (prompt and completion)
    request_bytes: int = 0  # the input tensors' bytes sent (mesh)
    response_bytes: int = 0  # the output tensors' bytes received (mesh)
    teacher_compute_s: float | None = None  # the server's compute time for these requests (mesh)
    teacher_counted_tokens: int | None = None  # positions the server counted (its metrics; mesh)
    losses: list[float] = field(default_factory=list)
    cpu: CpuUsage | None = None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu"] = self.cpu.as_dict() if self.cpu else None
        d["steps_per_s"] = round(self.steps_per_s, 4)
        d["losses"] = [round(x, 4) for x in self.losses]
        for k in ("seconds", "generate_s", "score_s", "train_s"):
            d[k] = round(d[k], 4)
        return d


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's counters by family (labels dropped; one model), from its Prometheus text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode("utf-8")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Loop:
    """The student, its prompts and the steps both variants run; `reset` before each measurement
    puts back the initial weights and seeds the sampler, so every loop does the same work."""

    def __init__(self, m: Models, *, steps: int, batch: int, new_tokens: int, lr: float, seed: int,
                 choice: DeviceChoice) -> None:
        self.m, self.steps, self.batch, self.new_tokens, self.lr, self.seed = m, steps, batch, new_tokens, lr, seed
        self.choice = choice
        self.initial = copy.deepcopy(m.student.state_dict())
        self.prompt_len = int(m.prompts.shape[1])

    def _autocast(self) -> Any:
        return self.choice.autocast(enabled=self.choice.cuda)

    def reset(self) -> torch.optim.Optimizer:
        self.m.student.load_state_dict(self.initial)
        torch.manual_seed(self.seed)
        return torch.optim.AdamW(self.m.student.parameters(), lr=self.lr)

    def generate(self, step: int) -> dict[str, torch.Tensor]:
        """The student samples `new_tokens` after step `step`'s prompts, with its current weights."""
        prompts = self.m.prompts[step * self.batch:(step + 1) * self.batch]
        with torch.no_grad(), self._autocast():
            ids = self.m.student.generate(  # type: ignore[operator]
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0,
                temperature=1.0, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                pad_token_id=self.m.pad_id)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def train(self, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], teacher_lp: torch.Tensor) -> float:
        """One step on the sampled-token policy-gradient loss over the completion tokens."""
        from distill.losses import sampled_token_pg_loss

        ids = batch["input_ids"]
        next_ids = torch.full_like(ids, -100)
        next_ids[:, self.prompt_len - 1:-1] = ids[:, self.prompt_len:]
        with self._autocast():
            logits = self.m.student(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        loss = sampled_token_pg_loss(logits, next_ids, teacher_lp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    def _times(self, seconds: float, phases: list[float], losses: list[float], batches: int) -> StepTimes:
        t = self.prompt_len + self.new_tokens
        return StepTimes(self.steps, seconds, phases[0], phases[1], phases[2], batches * self.batch * self.new_tokens,
                         batches * self.batch * t, losses=losses)

    def inprocess(self, pids: list[int]) -> StepTimes:
        """Generate, score in this process, train: one step after the other (staleness 0)."""
        opt = self.reset()
        phases, losses = [0.0, 0.0, 0.0], []
        meter = CpuMeter(pids)
        meter.start()
        t0 = time.perf_counter()
        for step in range(self.steps):
            a = time.perf_counter()
            batch = self.generate(step)
            self.choice.synchronize()
            b = time.perf_counter()
            lp = score_inprocess(self.m.teacher, batch["input_ids"]).clone()  # a normal tensor for autograd
            self.choice.synchronize()
            c = time.perf_counter()
            losses.append(self.train(opt, batch, lp))
            self.choice.synchronize()
            phases[0] += b - a
            phases[1] += c - b
            phases[2] += time.perf_counter() - c
        out = self._times(time.perf_counter() - t0, phases, losses, self.steps)
        out.cpu = meter.stop()
        return out

    def mesh(self, reader: Any, metrics_port: int, pids: list[int]) -> StepTimes:
        """Submit step n, generate step n+1 while the teacher scores step n, train step n (staleness 1)."""
        opt = self.reset()
        before = scrape(metrics_port)
        phases, losses = [0.0, 0.0, 0.0], []
        sent = received = 0
        meter = CpuMeter(pids)
        meter.start()
        t0 = time.perf_counter()
        batch = self.generate(0)
        self.choice.synchronize()
        phases[0] += time.perf_counter() - t0
        fut = reader.submit(batch)
        for step in range(self.steps):
            a = time.perf_counter()
            if step + 1 < self.steps:
                nxt = self.generate(step + 1)
                self.choice.synchronize()
                nxt_fut = reader.submit(nxt)
            b = time.perf_counter()
            out = fut.result(120)
            c = time.perf_counter()
            losses.append(self.train(opt, batch, out[TOKENS_OUT]))
            self.choice.synchronize()
            phases[0] += b - a
            phases[1] += c - b
            phases[2] += time.perf_counter() - c
            sent += sum(t.numel() * t.element_size() for t in batch.values())
            received += sum(t.numel() * t.element_size() for t in out.values())
            if step + 1 < self.steps:
                batch, fut = nxt, nxt_fut
        res = self._times(time.perf_counter() - t0, phases, losses, self.steps)
        res.cpu = meter.stop()
        after = scrape(metrics_port)
        res.request_bytes, res.response_bytes = sent, received
        res.teacher_compute_s = (after.get("nv_inference_compute_infer_duration_us", 0.0)
                                 - before.get("nv_inference_compute_infer_duration_us", 0.0)) / 1e6
        res.teacher_counted_tokens = int(after.get("teacher_useful_tokens_total", 0.0)
                                         - before.get("teacher_useful_tokens_total", 0.0))
        return res
