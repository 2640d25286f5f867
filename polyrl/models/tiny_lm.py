"""Tiny causal LMs in the transformers layout, with tokenizers built offline (tests and the toy text model).

Upstream tiny test checkpoints fetch their tokenizer from the Hub, which cannot work offline, so the tokenizers
are built here from the `tokenizers` library and wrapped in `PreTrainedTokenizerFast`:

* `byte_tokenizer`: byte-level BPE without merges (256 byte tokens + the special tokens), any text round-trips;
* `word_tokenizer`: one token per word of a closed vocabulary (the toy task's), split on whitespace and
  punctuation, decoded with single spaces.

`save_tiny_causal_lm` writes `config.json`, `model.safetensors`, `generation_config.json` and the tokenizer files,
so `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` (and `model=causal_lm`) load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML layout, so a tiny model exercises the chat-template path as a real Qwen2/Qwen3 checkpoint does
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A byte-level tokenizer (no merges): 256 byte tokens, then `SPECIALS`; pad and EOS are `<|endoftext|>` /
    `<|im_end|>` as in Qwen checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   chat_template=chat_template)


def word_tokenizer(words: list[str], chat_template: str | None = None):
    """A word-level tokenizer over `words` (plus `<unk>` and `SPECIALS`): one token per word or punctuation mark."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in list(SPECIALS) + sorted(set(words)):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", chat_template=chat_template)


@dataclass
class TinyLMSpec:
    """A Qwen3-class decoder; sizes small enough for a CPU test or the toy task."""

    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 64
    max_positions: int = 256
    tie_embeddings: bool = True


def build_tiny_causal_lm(tokenizer, spec: TinyLMSpec | None = None, seed: int = 0):
    """A random-weight `Qwen3ForCausalLM` sized by `spec` for `tokenizer`'s vocabulary."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    spec = spec or TinyLMSpec()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, tie_word_embeddings=spec.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def save_tiny_causal_lm(path: str | Path, tokenizer=None, spec: TinyLMSpec | None = None, seed: int = 0) -> Path:
    """Build and save a tiny causal LM with `tokenizer` (default: the byte-level one with a ChatML template)."""
    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
    model = build_tiny_causal_lm(tokenizer, spec, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
