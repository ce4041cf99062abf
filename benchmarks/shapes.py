"""Causal LMs of real shapes with random weights, for GPU measurements that need the real cost of
a forward pass (its matrices, its vocabulary) but not its accuracy.

    .venv/bin/python -m benchmarks.shapes qwen2.5-1.5b --tokenizer DIR|smoke --out DIR [--context 1024]
        [--device cuda --dtype BF16]

The directory is a `save_pretrained` one (config, weights, and the tokenizer files copied from
--tokenizer, e.g. the LLM example's teacher, whose ids all fall inside the larger vocabulary; `smoke`
is the LLM example's smoke tokenizer, trained and cached first if there is none), so
`teacher-server --model hf:DIR`, `benchmarks.llm_serving --teacher DIR` and
`benchmarks.teacher_memory --teacher DIR` take it as they take a trained teacher.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.device import DTYPES

# Published configurations (hidden size, layers, heads, vocabulary) of the models the GPU rows name.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6},
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6},
    "qwen2.5-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write(shape: str, tokenizer: Path, out: Path, *, context: int, device: str, dtype: str, seed: int = 0) -> Path:
    """Build the model on `device` (fast random init), save it in `dtype` with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    if tok.pad_token_id is None:
        raise SystemExit(f"--tokenizer {tokenizer}: the tokenizer has no pad token")
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=context, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if len(tok) > config.vocab_size:
        raise SystemExit(f"the tokenizer's {len(tok)} ids do not fit {shape}'s vocabulary of {config.vocab_size}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {params / 1e9:.2f} B parameters in {dtype}, context {context}, written to {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", required=True, type=Path,
                   help="a directory with tokenizer.json, or `smoke`: the LLM example's smoke tokenizer")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--context", type=int, default=1024, help="max_position_embeddings (default 1024)")
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster)")
    p.add_argument("--dtype", type=str.upper, choices=list(DTYPES), default="BF16")
    a = p.parse_args(argv)
    if str(a.tokenizer) == "smoke":  # in this process: a process of its own to find it imports torch again
        from examples.llm.tokenizer import get_tokenizer, tokenizer_dir

        a.tokenizer = tokenizer_dir(smoke=True)
        if not (a.tokenizer / "tokenizer.json").is_file():
            get_tokenizer(smoke=True)
    write(a.shape, a.tokenizer, a.out, context=a.context, device=a.device, dtype=a.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
