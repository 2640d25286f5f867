"""Any transformers causal LM as a token policy (`model=causal_lm`: Qwen2 / Qwen3 class and the like).

`model.path` is a local directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (config.json, weights, tokenizer files). A prompt is wrapped in the tokenizer's chat template as one user
message (with the generation prompt) when the tokenizer has a template, and tokenized as it is otherwise.
`model.max_sequence_length` bounds the prompt's tokens (a longer prompt is an error naming its length).

Position ids follow the attention mask (cumsum − 1), so left-padded prompts and the cached decoding steps see the
positions an unpadded sequence would: the rollout's per-token log-probs equal a teacher-forced recompute
(tests/test_token_rollout.py).

The rollout decodes into a preallocated KV cache (transformers' `StaticCache`) with the same shapes at every step,
so on a GPU one decoding step is one CUDA graph replay (`model.options.cuda_graphs`, torch.compile's
"reduce-overhead"): eager decoding of a 28-layer model spends most of a step launching kernels from Python
(docs/performance.md).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import UserError
from ..latents import at_least_float32
from .base import Cond, Prompt, register_model, text_only
from .options import read_options

# KV-cache lengths are rounded up to a multiple of these: chunks of similar prompt lengths reuse one cache (and, on a
# GPU, its compiled graph: coarse buckets, few compiles); without graphs a finer one wastes less attention on padding
GRAPH_CACHE_BUCKET, CACHE_BUCKET = 256, 16
KEPT_DECODINGS = 2  # static caches (and their graphs) kept at once, the most recently used ones

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
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
    # model.options: cuda_graphs — on a GPU, each rollout decoding step is one CUDA graph replay (static KV cache)
    options = {"cuda_graphs": True}

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
        options = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.cuda_graphs = bool(options["cuda_graphs"]) and device.type == "cuda"
        # transformers 4.x positions its static cache by a `cache_position` argument: keep the generic decoding there
        self._static_cache = "cache_position" not in params
        self._decodings: dict[tuple[int, int], StaticCacheDecoding] = {}

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
        net = self.networks["model"]  # the live entry: the actor may swap in another policy (reference, teacher)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = net(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=use_cache, logits_to_keep=keep, **{self._cache_arg: cache})
        new_cache = getattr(out, "cache", None) if self._cache_arg == "cache" else getattr(out, "past_key_values", None)
        return at_least_float32(out.logits), new_cache

    def decoding(self, batch: int, prompt_width: int, max_new_tokens: int) -> StaticCacheDecoding | None:
        """The rollout's decoder for a chunk of `batch` prompts left-padded to `prompt_width` tokens (reused across
        chunks and steps of the same bucketed shape; `sampling.tokens.decoding_for`)."""
        if not self._static_cache:
            return None
        # a sharded network (FSDP2 / tensor parallel) gathers its weights in hooks a CUDA graph cannot hold
        graphs = self.cuda_graphs and not any(isinstance(w, DTensor) for w in self.network.parameters())
        bucket = GRAPH_CACHE_BUCKET if graphs else CACHE_BUCKET
        length = -(-(prompt_width + max_new_tokens) // bucket) * bucket
        key = (batch, length)
        if key not in self._decodings:
            while len(self._decodings) >= KEPT_DECODINGS:
                self._decodings.pop(next(iter(self._decodings)))
            self._decodings[key] = StaticCacheDecoding(self, batch, length, graphs=graphs)
        self._decodings[key] = self._decodings.pop(key)  # most recently used last
        return self._decodings[key]


class StaticCacheDecoding:
    """Prefill and decoding steps into one preallocated KV cache of `length` positions per row.

    The attention mask is one (batch, length) tensor for the whole chunk: the prompt's mask, then 1 at every later
    position (the causal mask hides those not yet written; a row that has ended keeps decoding padding nobody
    reads). Every decoding step has the same shapes — token (B, 1), position ids (B, 1), this mask — so it is one
    compiled graph, replayed as a CUDA graph on a GPU (`model.options.cuda_graphs`). The cache's write position is
    its own counter, reset at each prefill.
    """

    def __init__(self, policy: CausalLMPolicy, batch: int, length: int, graphs: bool = False,
                 backend="inductor"):
        from transformers import StaticCache

        self.policy, self.batch, self.length = policy, batch, length
        self.cache = StaticCache(config=policy.network.config, max_cache_len=length)
        self.mask = torch.zeros((batch, length), dtype=torch.long, device=policy.device)
        torch._dynamo.mark_static_address(self.mask)  # refilled in place per chunk: the graph reads it where it is
        self.cuda_graphs = graphs and backend == "inductor" and policy.device.type == "cuda"
        if graphs:  # one graph for every step (a `backend` other than inductor: tests trace the step on a CPU)
            # each cache instance is a new guard on the same code: allow as many as a long run's cache shapes
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._forward_step = torch.compile(self._forward_step, backend=backend, dynamic=False,
                                               mode="reduce-overhead" if self.cuda_graphs else None)

    def prefill(self, prompt: torch.Tensor, mask: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Logits (B, V) of the prompts' last positions; writes the prompts into the cache from position 0."""
        p = prompt.shape[1]
        self.cache.reset()
        self.mask.zero_()
        self.mask[:, :p] = mask
        self.mask[:, p:] = 1
        self.position = mask.long().sum(1, keepdim=True) - 1  # the last prompt token's position id
        logits, _ = self.policy.forward(prompt, mask, cond, self.cache, keep=1, use_cache=True)
        return logits[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after feeding each row's next token (B,)."""
        self.position = self.position + 1
        p = self.policy
        p.flops += self.batch * decoder_forward_flops(p._body_params, p._head_params, p._layers, p._attn_width, 1, 1,
                                                      self.length)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits were consumed
        return self._forward_step(token.unsqueeze(1), self.position)

    def _forward_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        p = self.policy
        with torch.autocast(p.device.type, dtype=p.dtype, enabled=p.dtype.itemsize < 4):
            out = p.network(input_ids=token, attention_mask=self.mask, position_ids=position, use_cache=True,
                            logits_to_keep=1, **{p._cache_arg: self.cache})
        return at_least_float32(out.logits[:, -1])
