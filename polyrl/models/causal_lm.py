"""Any transformers causal LM as a token policy (`model=causal_lm`: Qwen2 / Qwen3 class and the like).

`model.path` is a local directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (config.json, weights, tokenizer files). A prompt is wrapped in the tokenizer's chat template as one user
message (with the generation prompt) when the tokenizer has a template, and tokenized as it is otherwise.
`model.max_sequence_length` bounds the prompt's tokens (a longer prompt is an error naming its length).

Position ids follow the attention mask (cumsum − 1), so left-padded prompts and the cached decoding steps see the
positions an unpadded sequence would: the rollout's per-token log-probs equal a teacher-forced recompute
(tests/test_token_rollout.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .base import Cond, Prompt, register_model, text_only

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the projections of every Qwen / Llama-style decoder layer
CAUSAL_LM_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def decoder_forward_flops(body_params: int, head_params: int, layers: int, attn_width: int, new_tokens: int,
                          kept: int, context: int) -> float:
    """Model FLOPs of one forward of one sequence (docs/algorithms.md §6): 2·params per token through the decoder
    body (its linear layers), 2·params of the LM head per kept position, and attention 4·L·d_attn·T·C for T new
    tokens attending to C positions (cached + new; masked positions are computed too)."""
    return float(2 * body_params * new_tokens + 2 * head_params * kept + 4 * layers * attn_width * new_tokens * context)


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a response: the generation config's EOS ids (Qwen lists two) and the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids += source if isinstance(source, list) else [source] if source is not None else []
    return sorted(set(ids))


@register_model("causal_lm")
class CausalLMPolicy:
    policy_kind = "tokens"
    default_lora_targets = CAUSAL_LM_LORA_TARGETS

    def __init__(self, cfg, device: torch.device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path={str(path)!r} is not a transformers model directory (no config.json)")
        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.network = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype).to(device)
        self.network.eval().requires_grad_(False)
        self.networks = {"model": self.network}
        self.max_prompt_tokens = int(cfg.max_sequence_length)
        self.eos_token_ids = eos_ids(self.network, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        # the cache argument was renamed (past_key_values -> cache) in transformers 5.x
        params = inspect.signature(self.network.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._prompt_ids: dict[str, list[int]] = {}
        self.flops = 0.0
        c = self.network.config
        head = self.network.get_output_embeddings()
        linears = sum(m.weight.numel() for m in self.network.modules() if isinstance(m, torch.nn.Linear))
        self._head_params = head.weight.numel()
        self._body_params = linears - self._head_params
        self._layers = c.num_hidden_layers
        self._attn_width = c.num_attention_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    # ------------------------------------------------------------------------------------------- text
    def prompt_text(self, text: str) -> str:
        """The text the model reads for a prompt: the chat template around one user message, or the prompt."""
        if not self.chat:
            return text
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)

    def encode_prompts(self, prompts: list[Prompt]) -> tuple[list[list[int]], Cond]:
        out = []
        for text in text_only(prompts, "model=causal_lm"):
            if text not in self._prompt_ids:
                ids = self.tokenizer(self.prompt_text(text), add_special_tokens=not self.chat).input_ids
                if len(ids) > self.max_prompt_tokens:
                    raise UserError(f"a prompt has {len(ids)} tokens, more than model.max_sequence_length="
                                    f"{self.max_prompt_tokens} ({text[:60]!r}...); raise model.max_sequence_length")
                self._prompt_ids[text] = list(ids)
            out.append(self._prompt_ids[text])
        return out, {}

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        """Response texts (offline DPO pairs) -> ids as the model would generate them: the text, then EOS."""
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_token_ids[0]
        return [list(self.tokenizer(t, add_special_tokens=False).input_ids) + [eos] for t in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------- network
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cond: Cond | None = None,
                cache: Any = None, keep: int = 0, use_cache: bool = False) -> tuple[torch.Tensor, Any]:
        b, t = input_ids.shape
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        kept = keep or t
        self.flops += b * decoder_forward_flops(self._body_params, self._head_params, self._layers, self._attn_width,
                                                t, kept, attention_mask.shape[1]) * (3 if torch.is_grad_enabled() else 1)
        # bf16/fp16 weights: autocast runs the float32 LoRA weights in the same low precision
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.network(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=keep, **{self._cache_arg: cache})
        new_cache = getattr(out, "cache", None) if self._cache_arg == "cache" else getattr(out, "past_key_values", None)
        return out.logits.float(), new_cache
