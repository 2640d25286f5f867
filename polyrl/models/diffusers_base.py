"""What every diffusers-layout model shares: loading components from a local directory, the per-prompt
conditioning cache, the low-precision forward with its FLOP count, and guidance by a negative prompt.

A family subclasses `DiffusersPolicy` and writes only what is its own: which components it needs, how prompts
are encoded (`_encode_one`), the latent layout, the sigma grid, the network call (`_network_forward`) and its
FLOPs (`forward_flops`), the guidance combination (`_guide`), decode and encode.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from ..latents import Latents, at_least_float32
from .base import Cond, Guidance, Media, Prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


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


def load_component(root: Path, name: str, spec: list, dtype: torch.dtype | None):
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


def frozen(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    return module.to(device).eval().requires_grad_(False)


class DiffusersPolicy:
    """Base of the diffusers-layout adapters (see the module docstring for what a subclass provides)."""

    default_lora_targets: list[str] = []
    family = "diffusers"
    condition_images = False  # True: every prompt carries condition images (the trainer refuses data rows without)

    def __init__(self, cfg, device: torch.device, needed: tuple[str, ...]):
        self.root = Path(cfg.path)
        self.present = pipeline_components(self.root, needed, self.family)
        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.networks: dict[str, torch.nn.Module] = {}
        self._cache: dict[str, Cond] = {}
        self.flops = 0.0  # model FLOPs executed so far (docs/algorithms.md §6); the trainer reads and resets it

    def load(self, name: str, dtype: torch.dtype | None = None):
        """Component `name` of the checkpoint (None when the checkpoint does not ship it)."""
        if name not in self.present:
            return None
        return load_component(self.root, name, self.present[name], dtype)

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoising network (every diffusers layout names it `transformer`)."""
        return self.networks["transformer"]

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        """One prompt's conditioning, each tensor without a batch dimension."""
        raise NotImplementedError

    def _collate(self, conds: list[Cond]) -> Cond:
        """Per-prompt conditioning -> a batch (fixed-length tensors stack; subclasses pad variable lengths)."""
        return {k: torch.stack([c[k] for c in conds]) for k in conds[0]}

    @staticmethod
    def _cache_key(prompt: Prompt) -> str:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)

    def encode_prompts(self, prompts: list[Prompt]) -> Cond:
        """Conditioning, cached per prompt (the encoders are frozen)."""
        # one prompt per encoder call: a prompt's embedding must not depend on which batch it first arrived in
        # (batched matmuls round differently per batch size), or a resumed run would drift from an uninterrupted one
        keys = [self._cache_key(p) for p in prompts]
        todo = {k: p for k, p in zip(keys, prompts, strict=True) if k not in self._cache}
        for key in sorted(todo):
            with torch.no_grad():
                self._cache[key] = self._encode_one(todo[key])
        return self._collate([self._cache[k] for k in keys])

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """CFG-style guidance: the negative prompt's conditioning (1, ...); nothing without guidance."""
        if guidance.scale == 1.0:
            return {}
        return self.encode_prompts([guidance.negative_prompt])

    # ------------------------------------------------------------------------------------------- network
    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """Model FLOPs of one network forward of one sample (§6); each family counts its own architecture."""
        raise NotImplementedError

    def _network_forward(self, network: torch.nn.Module, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """The raw network call in `self.dtype` (inputs already cast); returns the velocity Latents."""
        raise NotImplementedError

    def network_for(self, sigma: torch.Tensor) -> torch.nn.Module:
        """The network that denoises at `sigma` (one `transformer`; two-expert models route by σ)."""
        return self.networks["transformer"]

    def _forward(self, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        batch = next(iter(latents.values())).shape[0]
        self.flops += self.forward_flops(latents, cond) * batch * (3 if torch.is_grad_enabled() else 1)
        # bf16/fp16 weights: autocast runs float32 LoRA weights and inputs in the same low precision
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = self._network_forward(self.network_for(sigma), latents, sigma, cond)
        return {k: at_least_float32(v) for k, v in out.items()}

    def _guide(self, uncond: Latents, cond: Latents, scale: float) -> Latents:
        """Classifier-free guidance v_u + s·(v_c − v_u) (§1 CFG); true-CFG models override."""
        return {k: uncond[k] + scale * (cond[k] - uncond[k]) for k in cond}

    def _pair(self, cond: Cond, shared: Cond) -> Cond:
        """(uncond ⊕ cond) conditioning for one batched CFG forward."""
        b = next(iter(cond.values())).shape[0]
        return {k: torch.cat([shared[k].expand(b, *shared[k].shape[1:]), cond[k]]) for k in cond}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        if not shared or guidance == 1.0:
            return self._forward(latents, sigma, cond)
        both = self._forward({k: torch.cat([v, v]) for k, v in latents.items()}, torch.cat([sigma, sigma]),
                             self._pair(cond, shared))
        halves = {k: v.chunk(2) for k, v in both.items()}
        return self._guide({k: h[0] for k, h in halves.items()}, {k: h[1] for k, h in halves.items()}, guidance)

    # ------------------------------------------------------------------------------------------- media
    def complete_latents(self, latents: Latents, cond: Cond) -> Latents:
        """The latents `decode` takes (models/base.py): the sampled ones, unless a subclass's condition occupies part
        of the latent state."""
        return latents

    def decode(self, latents: Latents) -> Media:
        raise NotImplementedError

    def encode_media(self, media: Media) -> Latents:
        raise NotImplementedError

