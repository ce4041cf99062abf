"""W9, the text path's cost: the same texts scored by one teacher-server sent as text (the teacher
tokenizes them) against sent as the teacher's own ids (tokenized beforehand on the client, not timed).

One teacher-server process serves a small random Llama (4 layers, hidden 256, so the model is not
trivial but the path's own cost shows) with a byte-level BPE of 4,096 entries trained on the
cross-tokenizer example's corpus (`examples.crosstok.corpus`, the Python standard library's source),
registered in a local etcd (a reader sends texts only to teachers whose record declares text
prompts). The texts are pieces of held-out corpus files of at most 384 bytes, 8 to a batch, read
through `DistillReader` with several batches in flight (``prefetch``), both variants asking for the
same scores (top-k 20 log-probabilities and the tokens' own log-probabilities):

  text  inputs ["TEXT"], one list of str per batch; outputs TEXT_IDS, TEXT_SPANS, TEXT_MASK and
        LOGITS (what a cross-tokenizer student reads)
  ids   inputs INPUT_IDS / ATTENTION_MASK: the same texts tokenized by the teacher's tokenizer on
        the client (its BOS included, padded on the right); outputs LOGITS

The variants are interleaved per repetition; the headline is the median of the per-repetition
ratios (text / ids rows per second; goal >= 0.9). Once per run, before the timing, the text path's
TEXT_IDS are checked against the client's tokenization and its scores against the ids path's.

    python -m benchmarks.text_path            # 5 repetitions of 48 batches
    python -m benchmarks.text_path --quick    # 3 repetitions of 8 batches, a smaller model
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    REPO_ROOT,
    interleave,
    machine_info,
    paired_ratios,
    rate_fields,
    rate_report,
    run_and_report,
)

GOAL = 0.9
MODEL_NAME = "text-llama"
SERVICE = "w9-text"
ROWS = 8  # texts per batch
MAX_BYTES = 384  # per text: at most one token a byte, so with the BOS every text fits the context
TOP_K = 20
VOCAB = 4096


def save_teacher(directory: Path, *, quick: bool) -> tuple[Any, list[str]]:
    """(tokenizer, held-out texts): the tokenizer (cached) and a random Llama over it saved in `directory`."""
    import transformers

    from examples.crosstok.corpus import context, get_tokenizer, load_texts, text_pieces

    corpus = load_texts(quick=True)
    tokenizer = get_tokenizer(VOCAB, corpus, quick=True)
    tokenizer.save_pretrained(str(directory))
    hidden, layers = (128, 2) if quick else (256, 4)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context(MAX_BYTES),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    return tokenizer, text_pieces(corpus.texts("held_out"), MAX_BYTES)


def batches_of(texts: Sequence[str], tokenizer: Any, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(text batches, id batches) of the same `count` x ROWS texts."""
    if len(texts) < ROWS:
        raise SystemExit(f"the corpus gave {len(texts)} held-out texts, fewer than one batch of {ROWS}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    as_text, as_ids = [], []
    for b in range(count):
        rows = [texts[(b * ROWS + r) % len(texts)] for r in range(ROWS)]
        encoded = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in rows]
        width = max(len(e) for e in encoded)
        ids = torch.full((ROWS, width), pad, dtype=torch.int64)
        mask = torch.zeros((ROWS, width), dtype=torch.int64)
        for r, e in enumerate(encoded):
            ids[r, :len(e)] = torch.tensor(e)
            mask[r, :len(e)] = 1
        as_text.append({"TEXT": rows})
        as_ids.append({"INPUT_IDS": ids, "ATTENTION_MASK": mask})
    return as_text, as_ids


def reader_options(registry: str, variant: str, prefetch: int) -> dict[str, Any]:
    scores = {"top_k": TOP_K, "logprobs": True, "token_logprobs": True, "output_dtype": "FP16"}
    if variant == "text":
        io = {"inputs": ["TEXT"], "outputs": ["TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS"]}
    else:
        io = {"inputs": ["INPUT_IDS", "ATTENTION_MASK"], "outputs": ["LOGITS"]}
    return {"registry": registry, "service": SERVICE, "model": MODEL_NAME, "prefetch": prefetch, "timeout": 600.0,
            **scores, **io}


def rate(registry: str, variant: str, batches: list[dict[str, Any]], prefetch: int) -> float:
    """Rows per second of one reader pass over `batches` (connecting to the teacher is not timed)."""
    from distill import DistillReader

    with DistillReader(batches, **reader_options(registry, variant, prefetch)) as reader:
        reader.stats()  # started: the registry read and the teacher connected before the clock starts
        started = time.perf_counter()
        rows = sum(len(b["TEXT"]) if variant == "text" else int(b["INPUT_IDS"].shape[0]) for b, _ in reader)
        return rows / (time.perf_counter() - started)


def check(registry: str, text_batches: list[dict[str, Any]], id_batches: list[dict[str, Any]]) -> float:
    """The text path's tokens are the client's, its scores the ids path's; the largest score difference."""
    from distill import DistillReader

    worst = 0.0
    with DistillReader(None, **reader_options(registry, "text", 1)) as by_text, \
            DistillReader(None, **reader_options(registry, "ids", 1)) as by_ids:
        for text, ids in zip(text_batches[:2], id_batches[:2], strict=True):
            a, b = by_text.score(text), by_ids.score(ids)
            mask = ids["ATTENTION_MASK"]
            width = mask.shape[1]
            if not torch.equal(a["TEXT_IDS"][:, :width] * mask, ids["INPUT_IDS"] * mask):
                raise SystemExit("the text path's TEXT_IDS are not the client's tokenization of the same texts")
            for name in ("LOGITS_TOPK_VALUES", "LOGITS_TOKEN_LOGPROBS"):
                x, y = a[name][:, :width].float(), b[name].float()
                keep = mask.bool() if x.dim() == 2 else mask.bool().unsqueeze(-1).expand_as(x)
                worst = max(worst, float((x - y).abs()[keep].max()))
    if worst > 0.05:
        raise SystemExit(f"the text path's scores differ from the ids path's by {worst:.3g}")
    return worst


def run(args: argparse.Namespace) -> dict[str, Any]:
    from discovery.local_etcd import LocalEtcd
    from teacher_server.launch import TeacherProcess

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="w9-") as name, LocalEtcd() as etcd:
        directory = Path(name) / "teacher"
        tokenizer, texts = save_teacher(directory, quick=args.quick)
        text_batches, id_batches = batches_of(texts, tokenizer, args.batches)
        server = ["--model", f"hf:{directory}", "--name", MODEL_NAME, "--device", "cpu", "--port", "0",
                  "--max-batch-size", str(ROWS), "--registry", etcd.address, "--service", SERVICE,
                  "--log-level", "WARNING"]
        with TeacherProcess(server, label="w9-teacher", cwd=REPO_ROOT, log=Path(name) / "teacher.log",
                            ready_timeout=300, stop_grace=10.0):
            worst = check(etcd.address, text_batches, id_batches)
            for variant, batches in (("text", text_batches), ("ids", id_batches)):  # warm-up
                rate(etcd.address, variant, batches[:2], args.prefetch)

            def show(rep: int, variant: str, value: float) -> None:
                print(f"rep {rep}  {variant:<4} {value:8.1f} rows/s", flush=True)

            rates = interleave(args.reps, {"text": lambda: rate(etcd.address, "text", text_batches, args.prefetch),
                                           "ids": lambda: rate(etcd.address, "ids", id_batches, args.prefetch)}, show)
    ratios = paired_ratios(rates["text"], rates["ids"])
    tokens = sum(int(b["ATTENTION_MASK"].sum()) for b in id_batches)
    return {
        "benchmark": "text_path",
        "workload": "W9",
        "settings": {"batches": args.batches, "rows_per_batch": ROWS, "max_bytes_per_text": MAX_BYTES,
                     "tokens_per_pass": tokens, "reps": args.reps, "prefetch": args.prefetch, "top_k": TOP_K,
                     "teacher": f"random Llama over a {len(tokenizer)}-entry byte-level BPE, "
                                f"{'2 layers, hidden 128' if args.quick else '4 layers, hidden 256'}, "
                                f"max batch {ROWS}, CPU",
                     "text": "DistillReader inputs=['TEXT'], outputs TEXT_IDS, TEXT_SPANS, TEXT_MASK, LOGITS",
                     "ids": "DistillReader inputs INPUT_IDS/ATTENTION_MASK (tokenized beforehand), outputs LOGITS"},
        "machine": machine_info(torch_threads=1),
        "largest_score_difference": round(worst, 6),
        **rate_fields(rates, ratios, "ratio_text_vs_ids", GOAL, digits=2),
    }


def report(doc: dict[str, Any]) -> str:
    return rate_report(doc, ("text", "ids"), "ratio_text_vs_ids")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions of 8 batches, a smaller model")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, 3 with --quick)")
    p.add_argument("--batches", type=int, default=None, help="batches of 8 texts a pass (default 48, 8 with --quick)")
    p.add_argument("--prefetch", type=int, default=4, help="batches in flight (default 4)")
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    args.batches = args.batches or (8 if args.quick else 48)
    return run_and_report(lambda: run(args), "text_path_quick" if args.quick else "text_path", report)


if __name__ == "__main__":
    sys.exit(main())
