"""Stable Diffusion 3 / 3.5 adapter (MM-DiT + flow matching), loaded from a local diffusers directory.

Components are loaded one by one with `from_pretrained(path, subfolder=...)` as listed in `model_index.json`, so
a checkpoint may ship any subset of the three text encoders (CLIP-L, CLIP-G, T5): missing CLIP features and
pooled embeddings are zero-filled to the transformer's widths, and a missing T5 contributes no tokens.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..perf.flops import sd3_forward_flops
from .base import Cond, register_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SD3_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]


def _load_component(root: Path, name: str, spec: list, dtype: torch.dtype | None):
    """Load one pipeline component the way model_index.json names it (library, class)."""
    library, cls_name = spec
    if "Tokenizer" in cls_name:  # CLIPTokenizer, T5TokenizerFast, TokenizersBackend, ...
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(root / name))
    cls = getattr(importlib.import_module(library), cls_name)
    if "Scheduler" in cls_name:
        return cls.from_pretrained(str(root), subfolder=name)
    # diffusers takes `torch_dtype`, transformers (>= 4.56) takes `dtype`.
    kwargs = {} if dtype is None else {"torch_dtype" if library == "diffusers" else "dtype": dtype}
    return cls.from_pretrained(str(root / name), **kwargs)


def load_model_index(path: str | Path) -> dict:
    root = Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"model.path={str(root)!r} is not a diffusers directory (no model_index.json)")
    return json.loads(index.read_text())


def pipeline_components(root: Path, needed: tuple[str, ...], family: str) -> dict[str, list]:
    """model_index.json's present components (name -> [library, class]); a missing required one is an error."""
    index = load_model_index(root)
    present = {k: v for k, v in index.items() if isinstance(v, list) and v[0] is not None}
    missing = [n for n in needed if n not in present]
    if missing:
        raise ValueError(f"{root} has no {', '.join(map(repr, missing))} component; a {family} pipeline needs "
                         f"{', '.join(needed)}")
    return present


def _tokenize(tokenizer, prompts: list[str], max_length: int, device) -> torch.Tensor:
    out = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return out.input_ids.to(device)


def encode_sd3_prompts(text_encoders, tokenizers, prompts: list[str], transformer_config, max_sequence_length: int) -> Cond:
    """SD3 conditioning: CLIP penultimate hidden states (concatenated on features, zero-padded to the joint width)
    followed by T5 tokens on the sequence axis; pooled = concatenated CLIP projections, zero-padded."""
    clip_hidden, pooled = [], []
    for model, tok in zip(text_encoders[:2], tokenizers[:2], strict=False):
        if model is None:
            continue
        ids = _tokenize(tok, prompts, min(tok.model_max_length, 77), model.device)
        out = model(ids, output_hidden_states=True)
        pooled.append(out.text_embeds.float())
        clip_hidden.append(out.hidden_states[-2].float())
    if len(clip_hidden) == 2 and clip_hidden[0].shape[1] != clip_hidden[1].shape[1]:
        raise ValueError("the two CLIP tokenizers pad to different lengths")
    joint, pooled_dim = transformer_config.joint_attention_dim, transformer_config.pooled_projection_dim
    embeds = F.pad(torch.cat(clip_hidden, dim=-1), (0, joint - sum(h.shape[-1] for h in clip_hidden)))
    pooled = F.pad(torch.cat(pooled, dim=-1), (0, pooled_dim - sum(p.shape[-1] for p in pooled)))
    if text_encoders[2] is not None:
        tok = tokenizers[2]
        ids = _tokenize(tok, prompts, min(max_sequence_length, tok.model_max_length), text_encoders[2].device)
        t5 = text_encoders[2](ids).last_hidden_state.float()
        embeds = torch.cat([embeds, F.pad(t5, (0, joint - t5.shape[-1]))], dim=1)
    return {"prompt_embeds": embeds, "pooled": pooled}


@register_model("sd3")
class SD3Adapter:
    default_lora_targets = SD3_LORA_TARGETS

    def __init__(self, cfg, device: torch.device):
        root = Path(cfg.path)
        present = pipeline_components(root, ("transformer", "vae", "scheduler"), "SD3")
        dtype = _DTYPES[cfg.dtype]
        self.device, self.dtype = device, dtype
        self.transformer = _load_component(root, "transformer", present["transformer"], dtype).to(device)
        self.vae = _load_component(root, "vae", present["vae"], torch.float32).to(device)
        self.scheduler = _load_component(root, "scheduler", present["scheduler"], None)
        self.text_encoders, self.tokenizers = [], []
        for enc, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3")):
            if enc in present:
                model = _load_component(root, enc, present[enc], dtype).to(device).eval().requires_grad_(False)
                self.text_encoders.append(model)
                self.tokenizers.append(_load_component(root, tok, present[tok], None))
            else:
                self.text_encoders.append(None)
                self.tokenizers.append(None)
        if self.text_encoders[0] is None and self.text_encoders[1] is None:
            raise ValueError(f"{root}: SD3 needs at least one CLIP text encoder (text_encoder or text_encoder_2)")
        self.vae.requires_grad_(False).eval()
        # every decode call has the rollout chunk's shape: compiled (with NHWC convolutions on the GPU) the decoder
        # runs 2.7x faster; NHWC without compiling is 11% slower than NCHW (docs/performance.md, VAE decode)
        compiled = getattr(cfg, "compile", "none") != "none"
        self.vae_memory_format = torch.channels_last if compiled and device.type == "cuda" else torch.contiguous_format
        self.vae.to(memory_format=self.vae_memory_format)
        if compiled:
            self.vae.decoder.compile()
        self.max_sequence_length = int(cfg.max_sequence_length)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self._cache: dict[str, Cond] = {}
        self.flops = 0.0  # model FLOPs executed so far (ALGORITHMS.md §6); the trainer reads and resets it

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_uncached(self, prompts: list[str]) -> Cond:
        return encode_sd3_prompts(
            self.text_encoders, self.tokenizers, prompts, self.transformer.config, self.max_sequence_length
        )

    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Text conditioning, cached per prompt (the text encoders are frozen)."""
        # one prompt per encoder call: a prompt's embedding must not depend on which batch it first arrived in
        # (batched matmuls round differently per batch size), or a resumed run would drift from an uninterrupted one
        for p in sorted({p for p in prompts if p not in self._cache}):
            with torch.no_grad():
                enc = self._encode_uncached([p])
            self._cache[p] = {k: v[0] for k, v in enc.items()}
        return {k: torch.stack([self._cache[p][k] for p in prompts]) for k in ("prompt_embeds", "pooled")}

    # ------------------------------------------------------------------------------------------- diffusion
    def initial_noise(self, batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        f = self.vae_scale_factor
        if height % (f * self.transformer.config.patch_size) or width % (f * self.transformer.config.patch_size):
            raise ValueError(f"rollout.height/width must be multiples of {f * self.transformer.config.patch_size}")
        shape = (batch, self.transformer.config.in_channels, height // f, width // f)
        return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(self.device)

    def sigmas(self, num_steps: int, height: int | None = None, width: int | None = None) -> torch.Tensor:
        # SD3's shift does not depend on the image size
        self.scheduler.set_timesteps(num_steps)
        return self.scheduler.sigmas.float().cpu()

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        p = self.transformer.config.patch_size
        per_sample = sd3_forward_flops(self.transformer.config, (latents.shape[-2] // p) * (latents.shape[-1] // p),
                                       cond["prompt_embeds"].shape[1])
        self.flops += per_sample * latents.shape[0] * (3 if torch.is_grad_enabled() else 1)
        # bf16/fp16 weights: autocast runs float32 LoRA weights and inputs in the same low precision
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=sigma.float() * 1000,  # float32: bf16 would round 1000·σ to ~4 units
                encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
                pooled_projections=cond["pooled"].to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()

    def velocity(self, latents, sigma, cond: Cond, neg: Cond | None, guidance: float) -> torch.Tensor:
        if neg is None or guidance == 1.0:
            return self._forward(latents, sigma, cond)
        both = {k: torch.cat([neg[k], cond[k]]) for k in cond}
        v_u, v_c = self._forward(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both).chunk(2)
        return v_u + guidance * (v_c - v_u)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        z = latents.float() / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        # decoding only feeds the reward: with a low-precision network it runs in that precision too (≈3× faster)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            images = self.vae.decode(z.contiguous(memory_format=self.vae_memory_format), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.vae.config
        z = self.vae.encode(images.to(self.device) * 2 - 1).latent_dist.mean
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor
