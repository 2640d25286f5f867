"""BAGEL's generation network: a Qwen2 decoder with a mixture of transformers (MoT), read top to bottom.

BAGEL-7B-MoT (ByteDance-Seed/Bagel, `modeling/bagel/qwen2_navit.py` and `bagel.py`) keeps two full copies of every
Qwen2 layer's weights: the *understanding* expert (the original names: `q_proj`, `mlp`, `input_layernorm`, ...)
and the *generation* expert (the same names + `_moe_gen`). Each token is routed by its modality to one expert for
everything that acts per token (the norms, q/k/v/o projections, the q/k norms and the MLP); all tokens then meet in
one joint attention. When BAGEL generates an image, the sequence of one sample is

    [ <|im_start|> prompt tokens <|im_end|> ]  <|vision_start|>  latent patch tokens  <|vision_end|>
      understanding expert, causal              understanding     generation expert  understanding

The text is attended causally (BAGEL fills its KV cache with it first); every token of the image block attends to
the whole text and to the whole image block (BAGEL's `is_causal=False` query against the cache). Positions (1-D RoPE)
run 0..l−1 over the l text tokens and are l for every image-block token: the 2-D layout of the latent patches comes
from a sin-cos `latent_pos_embed` added to their input, with the timestep embedding, after `vae2llm`.

The module names are the public checkpoint's (`ema.safetensors`): `language_model.model.layers.3.self_attn.
q_proj_moe_gen.weight`, `time_embedder.mlp.0.weight`, `latent_pos_embed.pos_embed`, ... Only the generation path is
built: the ViT understanding branch (`vit_model.*`, `connector.*`, `vit_pos_embed.*`) and the text head
(`language_model.lm_head.*`) never take part in image generation and are not loaded.

A batch holds prompts of different lengths: each prompt is right-padded to the batch's longest (L tokens) and a mask
hides the padding; the image block then starts at index L for every sample, so the routing is three slices, the
same for the whole batch (`split_experts`). Its positions start at each sample's own prompt length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin
from torch import nn

GEN = "_moe_gen"  # the suffix of the generation expert's module names
GENERATION_ONLY = ("time_embedder.", "vae2llm.", "llm2vae.")  # trainable, outside the decoder


# ----------------------------------------------------------------------------------------------- routing
def split_experts(x: torch.Tensor, prefix: int, gen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, ...) -> (understanding tokens (B, S − gen, ...), generation tokens (B, gen, ...)): the generation tokens
    are the `gen` tokens after the first `prefix`; the rest (text, <|vision_start|>, <|vision_end|>) understanding."""
    return torch.cat([x[:, :prefix], x[:, prefix + gen:]], 1), x[:, prefix:prefix + gen]


def merge_experts(und: torch.Tensor, gen: torch.Tensor, prefix: int) -> torch.Tensor:
    """The inverse of `split_experts`."""
    return torch.cat([und[:, :prefix], gen, und[:, prefix:]], 1)


def routed(x: torch.Tensor, prefix: int, gen: int, und_fn, gen_fn) -> torch.Tensor:
    """Apply `und_fn` to the understanding tokens and `gen_fn` to the generation tokens (BAGEL's MoT routing)."""
    und, g = split_experts(x, prefix, gen)
    return merge_experts(und_fn(und), gen_fn(g), prefix)


# ----------------------------------------------------------------------------------------------- pieces
class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: w · x / sqrt(mean(x²) + eps), the normalisation in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """Qwen2's MLP: down(silu(gate(x)) · up(x)), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2's rotary embedding for integer positions (B, S): cos, sin of shape (B, S, 1, head_dim), angle
    p·θ^(−2i/head_dim) for i < head_dim/2, the half repeated (computed here, not a buffer: it has no weights)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], -1)[:, :, None]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁) for the halves x₁, x₂ of the head dimension."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MoTAttention(nn.Module):
    """Qwen2 attention (q/k/v with biases, o without, RMS q/k norms, GQA) with one weight set per expert."""

    def __init__(self, dim: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        for suffix in ("", GEN):
            setattr(self, f"q_proj{suffix}", nn.Linear(dim, heads * self.head_dim, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(dim, kv_heads * self.head_dim, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(dim, kv_heads * self.head_dim, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(heads * self.head_dim, dim, bias=False))
            setattr(self, f"q_norm{suffix}", RMSNorm(self.head_dim, eps))
            setattr(self, f"k_norm{suffix}", RMSNorm(self.head_dim, eps))

    def forward(self, x, prefix: int, gen: int, cos, sin, mask) -> torch.Tensor:
        b, s, _ = x.shape

        def project(name: str, heads: int) -> torch.Tensor:
            out = routed(x, prefix, gen, getattr(self, name), getattr(self, name + GEN))
            return out.view(b, s, heads, self.head_dim)

        q, k, v = project("q_proj", self.heads), project("k_proj", self.kv_heads), project("v_proj", self.kv_heads)
        q = rotate(routed(q, prefix, gen, self.q_norm, self.q_norm_moe_gen), cos, sin)
        k = rotate(routed(k, prefix, gen, self.k_norm, self.k_norm_moe_gen), cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                             v.transpose(1, 2).to(q.dtype), attn_mask=mask,
                                             enable_gqa=self.kv_heads != self.heads)
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim).to(x.dtype)
        return routed(out, prefix, gen, self.o_proj, self.o_proj_moe_gen)


class MoTDecoderLayer(nn.Module):
    """Pre-norm Qwen2 layer, every per-token part routed: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, dim: int, hidden: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.self_attn = MoTAttention(dim, heads, kv_heads, eps)
        for suffix in ("", GEN):
            setattr(self, f"mlp{suffix}", SwiGLU(dim, hidden))
            setattr(self, f"input_layernorm{suffix}", RMSNorm(dim, eps))
            setattr(self, f"post_attention_layernorm{suffix}", RMSNorm(dim, eps))

    def forward(self, x, prefix: int, gen: int, cos, sin, mask) -> torch.Tensor:
        h = routed(x, prefix, gen, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(h, prefix, gen, cos, sin, mask)
        return x + routed(x, prefix, gen, lambda t: self.mlp(self.post_attention_layernorm(t)),
                          lambda t: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(t)))


class MoTDecoder(nn.Module):
    """`language_model.model`: token embedding, the layers and the routed final norm."""

    def __init__(self, vocab_size: int, dim: int, hidden: int, layers: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(MoTDecoderLayer(dim, hidden, heads, kv_heads, eps) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)
        self.norm_moe_gen = RMSNorm(dim, eps)
        self.gradient_checkpointing = False  # set by ModelMixin.enable_gradient_checkpointing

    def forward(self, x, prefix: int, gen: int, cos, sin, mask) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = self._gradient_checkpointing_func(layer, x, prefix, gen, cos, sin, mask)
            else:
                x = layer(x, prefix, gen, cos, sin, mask)
        return routed(x, prefix, gen, self.norm, self.norm_moe_gen)


class LanguageModel(nn.Module):
    """`language_model`: only its `model` (the text head `lm_head` is understanding-only and not built)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.model = MoTDecoder(**kwargs)


class TimestepEmbedder(nn.Module):
    """DiT's timestep embedder on σ itself (BAGEL passes t ∈ [0, 1], no ×1000): MLP(cos(σ·f) ⊕ sin(σ·f)) with
    f_i = 10000^(−i/128), i < 128."""

    def __init__(self, dim: int, frequencies: int = 256):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], -1))


class PositionEmbedding(nn.Module):
    """`latent_pos_embed`: a fixed (max_side², dim) table, read at flat index row·max_side + column."""

    def __init__(self, max_side: int, dim: int):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(max_side * max_side, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[ids]


# ----------------------------------------------------------------------------------------------- the network
class BagelGenerator(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """BAGEL's image-generation network: (noisy latent patch tokens, σ, prompt tokens) -> velocity per patch token.

    `requires_grad_(True)` (a full fine-tune) makes only the generation path trainable: the generation expert
    (`*_moe_gen`) and the generation-only `time_embedder`, `vae2llm`, `llm2vae` (as BAGEL's own training with
    `freeze_und`); the understanding expert and the token embedding keep their weights, so the model still reads
    text as it did, and `latent_pos_embed` stays the fixed sin-cos table. LoRA goes on whatever modules
    `actor.lora_targets` names (by default the generation expert's linears).
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, rms_norm_eps: float, rope_theta: float,
                 patch_latent_dim: int, max_latent_size: int, start_of_image_id: int, end_of_image_id: int):
        super().__init__()
        if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
            raise ValueError(f"hidden_size {hidden_size}, heads {num_attention_heads} and kv heads "
                             f"{num_key_value_heads} do not divide")
        self.language_model = LanguageModel(
            vocab_size=vocab_size, dim=hidden_size, hidden=intermediate_size, layers=num_hidden_layers,
            heads=num_attention_heads, kv_heads=num_key_value_heads, eps=rms_norm_eps)
        self.time_embedder = TimestepEmbedder(hidden_size)
        self.vae2llm = nn.Linear(patch_latent_dim, hidden_size)
        self.llm2vae = nn.Linear(hidden_size, patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, hidden_size)

    def requires_grad_(self, requires_grad: bool = True):
        super().requires_grad_(False)
        if requires_grad:
            for name, p in self.named_parameters():
                if GEN in name or name.startswith(GENERATION_ONLY):
                    p.requires_grad_(True)
        return self

    def forward(self, latent_tokens: torch.Tensor, sigma: torch.Tensor, latent_ids: torch.Tensor,
                text_ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """Velocity (B, N, p²·C) of the noisy patch tokens `latent_tokens` (B, N, p²·C) at `sigma` (B,), with their
        `latent_pos_embed` indices `latent_ids` (N,), given prompt tokens `text_ids` (B, L) right-padded, `text_mask`
        (B, L) True on real tokens (L may be 0: BAGEL's text-unconditional branch has no text at all)."""
        c = self.config
        decoder = self.language_model.model
        b, n, _ = latent_tokens.shape
        length = text_ids.shape[1]
        embed = decoder.embed_tokens
        boundary = torch.tensor([c.start_of_image_id, c.end_of_image_id], device=text_ids.device)
        soi, eoi = embed(boundary).to(latent_tokens.dtype).unsqueeze(0).expand(b, 2, -1).split(1, 1)
        latents = (self.vae2llm(latent_tokens) + self.time_embedder(sigma)[:, None]
                   + self.latent_pos_embed(latent_ids)[None])
        x = torch.cat([embed(text_ids).to(latents.dtype), soi.to(latents.dtype), latents, eoi.to(latents.dtype)], 1)
        prefix = length + 1  # text (padded) and <|vision_start|>; the image block is index length .. S − 1

        lengths = text_mask.sum(1, keepdim=True)  # (B, 1) each prompt's own token count
        index = torch.arange(x.shape[1], device=x.device)
        positions = torch.where(index[None] < length, index[None], lengths)
        cos, sin = rope(positions, c.hidden_size // c.num_attention_heads, c.rope_theta)
        mask = attention_mask(text_mask, n + 2)

        h = decoder(x, prefix, n, cos, sin, mask)
        return self.llm2vae(h[:, prefix:prefix + n])


def attention_mask(text_mask: torch.Tensor, image_block: int) -> torch.Tensor:
    """(B, 1, S, S) bool, True where query i may attend key j, for S = L + `image_block`: a text query sees the real
    text keys j ≤ i (causal); an image-block query sees every real key. A padding query sees itself only (its
    output is never read, and a row with no key would be NaN)."""
    b, length = text_mask.shape
    s = length + image_block
    valid = torch.cat([text_mask.bool(), text_mask.new_ones(b, image_block, dtype=torch.bool)], 1)
    i = torch.arange(s, device=text_mask.device)
    sees = (i[None, :] <= i[:, None]) | (i[:, None] >= length)  # [query, key]: causal text, full image block
    mask = valid[:, None, :] & sees[None]
    return (mask | torch.eye(s, dtype=torch.bool, device=text_mask.device)[None])[:, None]
