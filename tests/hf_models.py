"""Tiny Hugging Face teachers saved with save_pretrained, for the vLLM-protocol tests: a random
Llama (optionally with a word-level tokenizer of its first 60 ids) and its reference log-probs."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, CONTEXT = 97, 64
WORDS = [f"w{i}" for i in range(3, 60)]


def save_llama(directory: Path, tokenizer: bool = False) -> None:
    """A tiny random Llama (and, with `tokenizer`, a word-level tokenizer of its first 60 ids)."""
    import tokenizers
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    if tokenizer:
        vocab = {"<pad>": 0, "<s>": 1, "[UNK]": 2, **{w: i for i, w in enumerate(WORDS, 3)}}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                                                    bos_token="<s>")
        fast.save_pretrained(str(directory))


def load_reference(directory: Path) -> torch.nn.Module:
    """The saved causal LM, loaded in process (local files only, eval mode): what answers are checked against."""
    import transformers

    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    return model.eval()


def reference_logprobs(model: torch.nn.Module, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(model(x) / T) of one prompt, [T, V]."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float() / temperature, dim=-1)
