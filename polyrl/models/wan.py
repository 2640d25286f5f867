"""Wan2.1 / Wan2.2 text-to-video adapter (DiT with self- and cross-attention + flow matching), loaded from a local
diffusers `WanPipeline` directory.

Facts taken from diffusers' `WanPipeline` (0.42.1), which this adapter reproduces:
- Latents: (B, C, F_lat, h, w) with C = the VAE's z_dim (16 for Wan2.1 and Wan2.2-A14B, 48 for Wan2.2-TI2V-5B),
  F_lat = (F − 1)/4 + 1 (a causal VAE: the first frame alone, then 4 frames per latent frame) and h, w the pixel
  size over the VAE's spatial factor (8; 16 for TI2V-5B, whose VAE patchifies 2×2 pixels before encoding).
- Text: UMT5 on the cleaned prompt (`prompt_clean`: ftfy, HTML unescape, whitespace), padded to
  `max_sequence_length`; the valid tokens' last hidden states are kept and zero-padded back to that length.
- Timestep: σ·1000 (the transformer embeds it sinusoidally). TI2V-5B's `expand_timesteps=True` gives one
  timestep per latent token, shape (B, F_lat·h/2·w/2); in text-to-video every token carries the same value.
- Guidance: true CFG with two forwards, v_u + s·(v_c − v_u) (here one batched forward of uncond ⊕ cond).
- Two experts (Wan2.2-A14B): `transformer` for t ≥ boundary_ratio·1000, `transformer_2` below, each with its own
  guidance scale (`guidance_scale` / `guidance_scale_2`).
- VAE: latents are normalised per channel, x = (z − latents_mean) / latents_std; decoding clamps to [−1, 1].

Differences from `WanPipeline`, on purpose:
- Sigmas: our flow-matching grid (`wan_sigmas`: linspace(1, 0, N+1) through the checkpoint's flow shift) replaces
  UniPC, whose multistep solver has no per-step Gaussian transition (the step math is ours, sampling/steps.py).
  UniPC applies the same shift to linspace(1, 1/1000, N+1)[:-1] and feeds the network *integer* timesteps
  (int64 of σ·1000); we feed float32 σ·1000 at rollout and in training alike.
- `guidance_scale_2` is a call argument of `WanPipeline`, not a checkpoint entry: polyrl takes it from
  `model.options.guidance_scale_2`, else from a `guidance_scale_2` entry of model_index.json, else both experts use
  the rollout's scale.

verl-omni's Wan2.2 adapters (DanceGRPO) differ from both: their text-to-video rollout passes one timestep per sample
even with expand_timesteps (the same values; the per-token form costs the time embedder once per token), and their
trainer truncates the timestep to an integer (`.long()`) while their rollout passes floats.
"""

from __future__ import annotations

import torch

from ..latents import Latents, MediaShape
from .base import Cond, Media, Prompt, register_model, text_only, video_latent_grid
from .diffusers_base import DiffusersPolicy, frozen, load_model_index
from .options import read_options

# Self-attention, cross-attention and FFN projections of every block (the attention q/k/v/out + FFN set that
# DiffSynth-Studio's Wan LoRA trains as "q,k,v,o,ffn.0,ffn.2", in diffusers' module names). verl-omni publishes
# no Wan LoRA list: its Wan2.2 recipe is a full fine-tune and its LoRA default is PEFT's "all-linear".
WAN_LORA_TARGETS = [
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
]

# actor.backend=fsdp2 (distributed/plan.py): each block is an FSDP / checkpointing unit. Sequence parallel: the video
# tokens are made inside the forward (Conv3d patch embedding, then flatten), so they are split as the first block's
# `hidden_states` argument; the rotary table (cos, sin), computed for the whole video by `rope`, is split with them,
# and so are Wan2.2-TI2V's per-token timesteps (the network's `timestep` argument, (B, S): the condition embedder
# then makes temb / timestep_proj for the local tokens; a per-sample timestep (B,) passes whole). Only the
# self-attention (attn1) is all-to-all: the cross-attention's queries are local video tokens and its keys the whole
# text on every rank. proj_out's output is gathered before the unpatchify. A14B's two experts share the plan.
WAN_PARALLEL_PLAN = {
    "blocks": "blocks", "heads": "num_attention_heads",
    "sequence": {"split_inputs": {"": {"timestep": "video"}, "blocks.0": {"hidden_states": "video"}},
                 "split": {"rope": "video"}, "gather": {"proj_out": "video"}, "attention": {"attn1": ["video"]}},
}


# ----------------------------------------------------------------------------------------------- pure math
def wan_forward_flops(config, video_tokens: int, text_tokens: int, per_token_timesteps: bool = False) -> float:
    """Wan DiT (`WanTransformer3DModel`), one sample with `video_tokens` patches (F_lat·h/p·w/p) and
    `text_tokens` (padded) text tokens (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·Sq·Sk·d).

    Per block: self-attention q/k/v/out over the video tokens (8·N·d²) + 4·N²·d; cross-attention q and out on the
    video tokens (4·N·d²), k and v on the text tokens (4·T·d²) + 4·N·T·d; FFN d → ffn_dim → d (4·N·d·ffn_dim). The
    blocks' modulation is a table plus the shared time projection (no per-block linear). Outside the blocks:
    the Conv3d patch embedding (2·N·C_in·p_t·p_h·p_w·d), the text embedder (text_dim → d → d per text token), the
    time embedder (freq_dim → d → d) and time projection (d → 6d) once per sample, or once per video token with
    `per_token_timesteps` (Wan2.2-TI2V's expand_timesteps), and proj_out (d → C_out·p_t·p_h·p_w per token).
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t = video_tokens, text_tokens
    patch = c.patch_size[0] * c.patch_size[1] * c.patch_size[2]
    out_channels = c.out_channels or c.in_channels
    per_block = 2 * n * 4 * d * d + 4 * n * n * d  # self-attention
    per_block += 2 * n * 2 * d * d + 2 * t * 2 * d * d + 4 * n * t * d  # cross-attention
    per_block += 2 * n * 2 * d * c.ffn_dim  # FFN
    flops = c.num_layers * per_block
    flops += 2 * n * c.in_channels * patch * d + 2 * n * d * out_channels * patch  # patch embedding, proj_out
    flops += 2 * t * (c.text_dim * d + d * d)  # text embedder
    flops += (n if per_token_timesteps else 1) * 2 * (c.freq_dim * d + d * d + d * 6 * d)  # time embedder + proj
    return float(flops)


def wan_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """σ_i = s·u_i / (1 + (s − 1)·u_i) for u = linspace(1, 0, N+1): float32, σ_0 = 1, σ_N = 0.

    The timestep shift of SD3 (Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image
    Synthesis", §5.3.2: t_m = √(m/n)·t_n / (1 + (√(m/n) − 1)·t_n) with s = √(m/n)), as Wan applies it with its
    `flow_shift` (diffusers `UniPCMultistepScheduler(use_flow_sigmas=True)`, `FlowMatchEulerDiscreteScheduler`
    with `shift`). verl-omni's Wan2.2 rollout and trainer build the same grid (`sd3_time_shift` on
    linspace(1, 0, N+1)), with shift 5.0 from its pipeline config rather than the checkpoint's scheduler.
    """
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u)).float()


def scheduler_shift(scheduler_config) -> float:
    """The flow shift a Wan checkpoint's scheduler applies: UniPC's `flow_shift` or FlowMatchEuler's `shift`."""
    for key in ("flow_shift", "shift"):
        if scheduler_config.get(key) is not None:
            return float(scheduler_config[key])
    return 1.0


def _select(values: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in values.items()}


SLICE_ABOVE_PIXELS = 2**22  # decoded frames × pixels of a whole chunk above which the VAE decodes video by video


@register_model("wan")
class WanPolicy(DiffusersPolicy):
    default_lora_targets = WAN_LORA_TARGETS
    family = "Wan"
    parallel_plan = {"transformer": WAN_PARALLEL_PLAN, "transformer_2": WAN_PARALLEL_PLAN}
    # model.options: guidance_scale_2 — the low-noise expert's CFG scale (Wan2.2-A14B; module docstring)
    options = {"guidance_scale_2": None}

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, ("vae", "text_encoder", "tokenizer", "scheduler"))
        for name in ("transformer", "transformer_2"):
            network = self.load(name, self.dtype)
            if network is not None:
                self.networks[name] = network.to(device)
        if not self.networks:
            raise ValueError(f"{self.root} has neither a 'transformer' nor a 'transformer_2' component")
        self.vae = frozen(self.load("vae", torch.float32), device)  # WanPipeline's own advice: the VAE in float32
        if getattr(cfg, "compile", "none") != "none":
            # the causal decoder runs once per latent frame with a feature cache: three graphs (first frame, one cached
            # frame, two); docs/performance.md (Wan2.2-TI2V-5B) has the measured effect
            self.vae.decoder.compile(dynamic=False)  # static: automatic dynamic shapes recompiled it a dozen times
        # UMT5 overflows in float16 (a T5 trait); bfloat16 has float32's range
        text_dtype = torch.bfloat16 if self.dtype == torch.float16 else self.dtype
        self.text_encoder = frozen(self.load("text_encoder", text_dtype), device)
        self.tokenizer = self.load("tokenizer")
        scheduler = self.load("scheduler")
        index = load_model_index(self.root)
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        self.boundary_ratio = index.get("boundary_ratio")
        options = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.guidance_scale_2 = options["guidance_scale_2"] or index.get("guidance_scale_2")
        self.num_train_timesteps = int(scheduler.config.get("num_train_timesteps", 1000))
        shift = getattr(cfg, "shift", None)
        self.shift = float(shift) if shift is not None else scheduler_shift(scheduler.config)
        self.max_sequence_length = int(cfg.max_sequence_length)
        vc = self.vae.config
        self.temporal_factor = int(vc.scale_factor_temporal)
        self.spatial_factor = int(vc.scale_factor_spatial)
        self._check_channels(self.transformer.config.in_channels, vc.z_dim)
        self._latents_mean = torch.tensor(vc.latents_mean, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
        self._latents_std = torch.tensor(vc.latents_std, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)

    def _check_channels(self, in_channels: int, z_dim: int) -> None:
        """The transformer's input channels fit this adapter's layout (text-to-video: the VAE's z_dim)."""
        if in_channels != z_dim:
            raise ValueError(f"{self.root}: the transformer takes {in_channels} channels but the VAE makes {z_dim}; an "
                             "image-to-video Wan checkpoint (condition channels) is not text-to-video: use model=wan_i2v")

    @property
    def transformer(self) -> torch.nn.Module:
        """The high-noise (or only) network; its config describes both experts' architecture."""
        return self.networks.get("transformer", self.networks.get("transformer_2"))

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        (text,) = text_only([prompt], self.family)
        length = self.max_sequence_length
        tokens = self.tokenizer([prompt_clean(text)], padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state[0].float()
        valid = int(mask.gt(0).sum())
        embeds = torch.zeros(length, hidden.shape[-1], device=self.device)
        embeds[:valid] = hidden[:valid]
        return {"prompt_embeds": embeds}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        _, ph, pw = self.transformer.config.patch_size
        grid = video_latent_grid("Wan", shape, self.temporal_factor, self.spatial_factor, (ph, pw))
        return {"x": (self.vae.config.z_dim, *grid)}

    def sigmas(self, num_steps: int, shape: MediaShape | None = None) -> torch.Tensor:
        # the shift is the checkpoint's (or model.shift): it does not depend on the video size
        return wan_sigmas(num_steps, self.shift)

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        c = self.transformer.config
        _, f, h, w = latents["x"].shape[1:]
        tokens = (f // c.patch_size[0]) * (h // c.patch_size[1]) * (w // c.patch_size[2])
        return wan_forward_flops(c, tokens, cond["prompt_embeds"].shape[1], per_token_timesteps=self.expand_timesteps)

    def _timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma.float() * self.num_train_timesteps  # float32: bf16 would round 1000·σ to ~4 units

    def high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """(B,) bool: which samples the high-noise expert (`transformer`) denoises, t ≥ boundary_ratio·1000."""
        t = self._timestep(sigma)
        if self.boundary_ratio is None:
            return torch.ones_like(t, dtype=torch.bool)
        return t >= self.boundary_ratio * self.num_train_timesteps

    def network_for(self, sigma: torch.Tensor) -> torch.nn.Module:
        """WanPipeline's routing: `transformer` for t ≥ boundary_ratio·1000, `transformer_2` below (a checkpoint
        that ships only one of them uses it for every t). `sigma` must fall on one side (`_forward` splits)."""
        if len(self.networks) == 1:
            return next(iter(self.networks.values()))
        high = self.high_noise(sigma)
        if bool(high.all()):
            return self.networks["transformer"]
        if not bool(high.any()):
            return self.networks["transformer_2"]
        raise ValueError("a batch with σ on both sides of boundary_ratio needs both experts: split it first")

    def _by_expert(self, fn, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """fn(latents, sigma, cond, high) on the high- and low-noise samples separately, results in batch order."""
        high = self.high_noise(sigma) if len(self.networks) > 1 or self.guidance_scale_2 is not None else None
        if high is None or bool(high.all()) or not bool(high.any()):
            return fn(latents, sigma, cond, True if high is None else bool(high[0]))
        out: Latents = {}
        for flag in (True, False):
            index = (high == flag).nonzero().squeeze(1)
            part = fn(_select(latents, index), sigma[index], _select(cond, index), flag)
            for k, v in part.items():
                if k not in out:
                    out[k] = v.new_empty((sigma.shape[0], *v.shape[1:]))
                out[k][index] = v
        return out

    def _forward(self, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        return self._by_expert(lambda x, s, c, _high: super(WanPolicy, self)._forward(x, s, c), latents, sigma, cond)

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        if self.guidance_scale_2 is None or not shared or guidance == 1.0:
            return super().velocity(latents, sigma, cond, shared, guidance)
        # A14B: the low-noise expert guides with guidance_scale_2 (WanPipeline: CFG on/off follows guidance_scale)
        scale_2 = float(self.guidance_scale_2)
        return self._by_expert(
            lambda x, s, c, high: super(WanPolicy, self).velocity(x, s, c, shared, guidance if high else scale_2),
            latents, sigma, cond)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        x = latents["x"].to(self.dtype)
        timestep = self._timestep(sigma)
        if self.expand_timesteps:
            # WanPipeline: mask[0][0][:, ::2, ::2] * t flattened, i.e. one timestep per latent token
            pt, ph, pw = network.config.patch_size
            timestep = timestep[:, None].expand(-1, x[0, 0, ::pt, ::ph, ::pw].numel())
        out = network(hidden_states=x, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
                      return_dict=False)[0]
        return {"x": out}

    # ------------------------------------------------------------------------------------------- media
    def decoded_pixels(self, x: torch.Tensor) -> int:
        """Frames × height × width of one video decoded from latents x (B, C, F, h, w)."""
        _, _, f, h, w = x.shape
        return ((f - 1) * self.temporal_factor + 1) * h * w * self.spatial_factor**2

    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        x = latents["x"].to(self.device, torch.float32)
        # WanPipeline's own expression: latents / (1 / latents_std) + latents_mean
        z = x / (1.0 / self._latents_std) + self._latents_mean
        # large videos one at a time (as verl-omni's Wan rollout decodes: the same result in a fraction of the
        # memory); small ones as one batch, twice as fast (the toy's 32 clips of 9×48×48: 4.1 → 2.0 s, one CPU thread)
        self.vae.use_slicing = x.shape[0] * self.decoded_pixels(x) > SLICE_ABOVE_PIXELS
        # decoding feeds the reward and the sample videos: with a low-precision network its convolutions run in that
        # precision too (float32 weights, autocast), as SD3's decode does (docs/performance.md: Wan2.2-TI2V-5B)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            video = self.vae.decode(z, return_dict=False)[0]  # (B, 3, T, H, W) in [-1, 1]
        return {"video": (video.permute(0, 2, 1, 3, 4).float() / 2 + 0.5).clamp(0, 1)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        video = media["video"].to(self.device, torch.float32).permute(0, 2, 1, 3, 4) * 2 - 1  # (B, 3, T, H, W)
        z = self.vae.encode(video).latent_dist.mean
        return {"x": (z - self._latents_mean) * (1.0 / self._latents_std)}
