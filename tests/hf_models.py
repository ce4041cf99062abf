"""Tiny Hugging Face teachers saved with save_pretrained, for the vLLM-protocol tests: a random
Llama (optionally with a word-level tokenizer of its first 60 ids) and its reference log-probs;
and a Llama shaped so that vLLM's CPU backend serves it too (`save_vllm_llama`), whose weights
are drawn from a seeded generator so that any torch and transformers rebuild the same model."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, CONTEXT = 97, 64
WORDS = [f"w{i}" for i in range(3, 60)]

VLLM_VOCAB, VLLM_CONTEXT, VLLM_SEED = 1000, 128, 20260
"""The vLLM-shaped Llama: vocabulary, context, and the seed its weights are drawn with."""


def save_llama(directory: Path, tokenizer: bool = False, seed: int = 0) -> None:
    """A tiny random Llama (and, with `tokenizer`, a word-level tokenizer of its first 60 ids);
    another `seed` draws another teacher of the same shape."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, pad_token_id=0)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    if tokenizer:
        _save_tokenizer(directory, WORDS)


def _save_tokenizer(directory: Path, words: list[str]) -> None:
    """A word-level tokenizer: <pad> 0, <s> 1, [UNK] 2, then `words` from id 3."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<s>": 1, "[UNK]": 2, **{w: i for i, w in enumerate(words, 3)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                                                bos_token="<s>")
    fast.save_pretrained(str(directory))


def save_vllm_llama(directory: Path) -> None:
    """A tiny random Llama that vLLM's CPU backend serves as well (head size 64), with a word-level
    tokenizer of its whole vocabulary (vLLM needs one). Every weight is drawn here from a generator
    seeded with `VLLM_SEED`, in the state dict's order, not by transformers' initialisation (which
    may change between versions): answers recorded from vLLM on this model stay comparable."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VLLM_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=VLLM_CONTEXT, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(VLLM_SEED)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.1 * noise)
            else:  # embeddings and projections: spread enough that top-k ranks are far from ties
                tensor.copy_(noise * (0.5 if "embed" in name else 0.15))
    model.save_pretrained(str(directory))
    _save_tokenizer(directory, [f"w{i}" for i in range(3, VLLM_VOCAB)])


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
