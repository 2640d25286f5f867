"""LTX-2 text-to-video-with-audio adapter (one DiT over video and audio tokens + flow matching), loaded from a
local diffusers `LTX2Pipeline` directory (LTX-2.0 and the LTX-2.3 layout: gated attention, prompt modulation,
per-modality text projections, perturbed attention for STG).

Latents: two entries, `{"video": (B, C, F, h, w), "audio": (B, C_a, L, M)}`, the unpacked forms `LTX2Pipeline`
accepts as `latents` / `audio_latents`, in the normalised space the transformer sees. Packing into tokens (video
(B, F·h·w, C) with the transformer's patch sizes, audio (B, L, C_a·M)) happens inside `_network_forward`; decode
reads F, h, w, L from the shapes. Both entries share σ and the transition std at every step, and one sample's
log-density is the mean over both entries' elements (`sampling/steps.step_latents`): one joint log-prob, the
same number verl-omni gets from its concatenation of video and audio tokens.

Facts taken from diffusers' `LTX2Pipeline` (0.42.1), which this adapter reproduces:
- Text: Gemma3 on the stripped prompt, left-padded to `max_sequence_length`; every layer's hidden state (embeddings
  included) stacked and flattened, then the frozen `connectors` turn it into a video and an audio text sequence and
  a mask (used for both streams).
- Audio length: round(num_frames / fps · sample_rate / hop / 4) latent frames (25 per second for LTX-2), from the
  audio VAE's config; latent frames F = (num_frames − 1)/8 + 1 and h, w = H/32, W/32 for the published VAE.
- Sigmas: linspace(1, 1/N, N) through the scheduler's dynamic shift with μ linear in the video token count
  (base_image_seq_len 1024 → base_shift 0.95, 4096 → 2.05; exponential time shift, `shift_terminal` stretch), then
  σ_N = 0. The pipeline steps audio with a deep copy of the scheduler only because diffusers' schedulers keep a
  step index; the copy has the same σ grid, so here both entries simply share σ (the step math is stateless).
- Timestep: σ·1000 in float32, passed as `timestep` and `sigma` for both streams; `use_cross_timestep` (LTX-2.3)
  modulates each stream's cross-modal attention with the other stream's σ (the same value in text-to-video).
- Guidance in x0 space (docs/video_audio.md): x̂0 = x − σ·v for each forward; with per-stream scales s (CFG), t
  (STG), m (modality isolation), x̂0_g = x̂0_c + (s−1)(x̂0_c − x̂0_u) + t(x̂0_c − x̂0_stg) + (m−1)(x̂0_c − x̂0_iso),
  then the guidance rescale φ of Lin et al. 2024 (§3.4) against x̂0_c, and v = (x − x̂0_g)/σ. Each term costs one
  forward: CFG the negative prompt (batched with the positive one), STG the positive prompt with self-attention
  replaced by its values in `stg_blocks`, modality isolation the positive prompt with the audio↔video attention off.
- VAE: video latents denormalised z·std/scaling_factor + mean; audio latents denormalised in packed form, decoded
  to a mel spectrogram, then the vocoder gives the waveform at its `output_sampling_rate` (24 kHz for LTX-2.0;
  the mel spectrogram itself is 16 kHz audio at hop 160).

Options (`model.options`, with `LTX2Policy.options` as defaults): the per-stream guidance beyond
`rollout.guidance_scale` (the video CFG scale), and the frame rate the video positions are conditioned on.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from ..latents import Latents, MediaShape, at_least_float32
from ..media import Audio
from .base import Cond, Guidance, Media, Prompt, register_model, text_only, video_latent_grid
from .diffusers_base import DiffusersPolicy, frozen, load_component

# verl-omni's LTX-2.3 LoRA targets (examples/flowgrpo_trainer/ltx2/run_ltx2_3_t2av_lora.sh, the same list as
# verl_omni/pipelines/ltx2_flow_grpo/common.py): q/k/v/out of the video and audio self- and text cross-attention,
# of both audio↔video attentions, and both streams' feed-forward layers. PEFT matches a target as a whole
# dotted suffix, so "attn1.to_q" does not also select "audio_attn1.to_q".
LTX2_LORA_TARGETS = [
    *(f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn",
                                    "video_to_audio_attn") for proj in ("to_q", "to_k", "to_v", "to_out.0")),
    "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2",
]
AUDIO_VIDEO_ATTENTION = ("audio_to_video_attn", "video_to_audio_attn")
COMPONENTS = ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "vocoder", "scheduler")
TIMESTEP_CHANNELS = 256  # the sinusoidal width every LTX2AdaLayerNormSingle embeds σ·1000 into


# ----------------------------------------------------------------------------------------------- pure math
def x0_from_velocity(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x̂0 = x − σ·v (flow matching x = (1−σ)·x0 + σ·ε, v = ε − x0); `sigma` (B,)."""
    return x - v * sigma.view(-1, *([1] * (x.dim() - 1)))


def velocity_from_x0(x: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """v = (x − x̂0)/σ, the inverse of `x0_from_velocity` (σ > 0: the last grid point is never a velocity call)."""
    return (x - x0) / sigma.view(-1, *([1] * (x.dim() - 1)))


def rescale_guidance(guided: torch.Tensor, cond: torch.Tensor, phi: float) -> torch.Tensor:
    """φ·g·std(c)/std(g) + (1−φ)·g per sample (std over every non-batch element, unbiased): the guidance rescale
    of Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed", §3.4, eq. 15–16, applied
    by LTX-2 to x̂0 (diffusers' `rescale_noise_cfg`)."""
    dims = list(range(1, guided.dim()))
    ratio = cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True)
    return phi * (guided * ratio) + (1 - phi) * guided


def guided_x0(cond: torch.Tensor, uncond: torch.Tensor | None, perturbed: torch.Tensor | None,
              isolated: torch.Tensor | None, scale: float, stg_scale: float, modality_scale: float,
              rescale: float) -> torch.Tensor:
    """LTX-2's guidance in x0 space for one stream (docs/video_audio.md, "Guidance"):
    x̂0_c + (s−1)(x̂0_c − x̂0_u) + t(x̂0_c − x̂0_stg) + (m−1)(x̂0_c − x̂0_iso), then `rescale_guidance` with φ
    when φ > 0. A term whose prediction is None is off (its forward was not run)."""
    out = cond
    if uncond is not None:
        out = out + (scale - 1) * (cond - uncond)
    if perturbed is not None:
        out = out + stg_scale * (cond - perturbed)
    if isolated is not None:
        out = out + (modality_scale - 1) * (cond - isolated)
    return rescale_guidance(out, cond, rescale) if rescale > 0 else out


def ltx2_mu(video_tokens: int, scheduler_config) -> float:
    """μ of the dynamic shift, linear in the video token count: base_shift at base_image_seq_len, max_shift at
    max_image_seq_len (LTX2Pipeline's `calculate_shift` with LTX-2's defaults 1024 → 0.95, 4096 → 2.05)."""
    c = scheduler_config
    lo, hi = c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096)
    base, top = c.get("base_shift", 0.95), c.get("max_shift", 2.05)
    slope = (top - base) / (hi - lo)
    return video_tokens * slope + base - slope * lo


def ltx2_sigmas(num_steps: int, video_tokens: int, scheduler) -> torch.Tensor:
    """The sampling grid of LTX2Pipeline, float32, σ_0 = 1 … σ_N = 0: u = linspace(1, 1/N, N) through the
    checkpoint scheduler's shift with μ = `ltx2_mu` (LTX-2: exponential time shift e^μ/(e^μ + 1/u − 1), then the
    `shift_terminal` stretch 1 − (1−σ)·(1−σ_term)/(1−σ_{N−1})), then 0 appended. Computed by a copy of the
    checkpoint's scheduler so that every configured shift variant, and its float32 rounding, is the pipeline's."""
    scheduler = copy.deepcopy(scheduler)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
                            mu=ltx2_mu(video_tokens, scheduler.config))
    return scheduler.sigmas.float().cpu()


def _adaln_flops(dim: int, num_params: int) -> int:
    """One LTX2AdaLayerNormSingle on one sample: sinusoid (256) → d → d, then d → num_params·d."""
    return 2 * (TIMESTEP_CHANNELS * dim + dim * dim + dim * num_params * dim)


def ltx2_forward_flops(config, video_tokens: int, audio_tokens: int, text_tokens: int, isolate_modalities: bool = False,
                       perturbed_blocks: int = 0) -> float:
    """LTX-2 DiT (`LTX2VideoTransformer3DModel`), one sample with N `video_tokens`, L `audio_tokens` and T text
    tokens (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·Sq·Sk·d).

    Per block, with d (video) and a (audio) the attention widths: video self-attention q/k/v/out 8·N·d² + 4·N²·d,
    audio self-attention 8·L·a² + 4·L²·a; text cross-attention q and out on the stream's tokens, k and v on the text
    (4·N·d² + 4·T·c_v·d + 4·N·T·d, and the same for audio with c_a); audio-to-video attention (queries video, width
    a): 2·N·d·a + 4·L·a² + 2·N·a·d + 4·N·L·a, video-to-audio (queries audio): 4·L·a² + 4·N·d·a + 4·L·N·a; the
    feed-forward d → 4d → d on each stream (16·N·d², 16·L·a²); gated attention adds a per-head gate (2·tokens·dim·heads)
    to every attention. `isolate_modalities` (modality guidance) skips both audio↔video attentions;
    `perturbed_blocks` (STG) counts blocks whose self-attentions return their values (only v and out run).
    Outside the blocks: proj_in / proj_out on each stream's tokens, the caption projections (LTX-2.0: text → d → d
    and text → a → a per text token) and, per sample, the AdaLN timestep embedders (time 6 or 9 params, prompt 2,
    cross-attention scale/shift 4 and gate 1, per stream).
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    a = c.audio_num_attention_heads * c.audio_attention_head_dim
    n, la, t = video_tokens, audio_tokens, text_tokens
    heads, audio_heads = c.num_attention_heads, c.audio_num_attention_heads
    video_gate = 2 * heads if c.gated_attn else 0  # per query token and input feature: Linear(dim → heads)
    audio_gate = 2 * audio_heads if c.audio_gated_attn else 0
    cross_gate = 2 * audio_heads if c.gated_attn else 0  # audio-to-video attention: video queries, audio heads

    def self_attention(tokens: int, width: int, gate: int, perturbed: bool) -> int:
        if perturbed:
            return 4 * tokens * width * width + gate * tokens * width
        return 8 * tokens * width * width + 4 * tokens * tokens * width + gate * tokens * width

    def block(perturbed: bool) -> int:
        flops = self_attention(n, d, video_gate, perturbed) + self_attention(la, a, audio_gate, perturbed)
        flops += 4 * n * d * d + 4 * t * c.cross_attention_dim * d + 4 * n * t * d + video_gate * n * d
        flops += 4 * la * a * a + 4 * t * c.audio_cross_attention_dim * a + 4 * la * t * a + audio_gate * la * a
        if not isolate_modalities:
            flops += 2 * n * d * a + 4 * la * a * a + 2 * n * a * d + 4 * n * la * a + cross_gate * n * d
            flops += 4 * la * a * a + 4 * n * d * a + 4 * la * n * a + audio_gate * la * a
        flops += 16 * n * d * d + 16 * la * a * a
        return flops

    perturbed_blocks = min(perturbed_blocks, c.num_layers)
    flops = (c.num_layers - perturbed_blocks) * block(False) + perturbed_blocks * block(True)
    flops += 2 * n * c.in_channels * d + 2 * n * d * (c.out_channels or c.in_channels)
    flops += 2 * la * c.audio_in_channels * a + 2 * la * a * (c.audio_out_channels or c.audio_in_channels)
    if c.use_prompt_embeddings:
        flops += 2 * t * (c.caption_channels * d + d * d) + 2 * t * (c.caption_channels * a + a * a)
    flops += _adaln_flops(d, 9 if c.cross_attn_mod else 6) + _adaln_flops(a, 9 if c.audio_cross_attn_mod else 6)
    if (c.cross_attn_mod or c.audio_cross_attn_mod) and c.use_prompt_adaln_single:
        flops += _adaln_flops(d, 2) + _adaln_flops(a, 2)
    flops += _adaln_flops(d, 4) + _adaln_flops(a, 4) + _adaln_flops(d, 1) + _adaln_flops(a, 1)
    return float(flops)


def pack_video(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """(B, C, F, H, W) -> tokens (B, F/p_t·H/p·W/p, C·p_t·p·p), frame-major; the channel then the patch offsets
    within a token (LTX2Pipeline's `_pack_latents`)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: torch.Tensor, frames: int, height: int, width: int, patch: int, patch_t: int) -> torch.Tensor:
    """The inverse of `pack_video` for a latent video of (frames, height, width)."""
    b = tokens.shape[0]
    x = tokens.reshape(b, frames // patch_t, height // patch, width // patch, -1, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, frames, height, width)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, L, M) -> tokens (B, L, C·M): one token per latent audio frame (LTX2Pipeline's `_pack_audio_latents`)."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """The inverse of `pack_audio`: (B, L, C·M) -> (B, C, L, M)."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------- guidance
@dataclass(frozen=True)
class StreamGuidance:
    """One stream's guidance scales: CFG s (1: off), STG t (0: off), modality isolation m (1: off), rescale φ."""

    scale: float = 1.0
    stg: float = 0.0
    modality: float = 1.0
    rescale: float = 0.0


def read_options(defaults: dict, given: dict) -> dict:
    """`model.options` over `defaults`, each value checked: numbers (null where the default is null), a list of
    block indices, a bool or null for use_cross_timestep; a bad value is a UserError naming its key."""
    out = dict(defaults)
    for key, value in given.items():
        default = defaults[key]
        try:
            if key == "stg_blocks":
                out[key] = [int(i) for i in (value or [])]
            elif key == "use_cross_timestep":
                if value not in (None, True, False):
                    raise ValueError
                out[key] = value
            else:
                out[key] = None if value is None and default is None else float(value)
        except (TypeError, ValueError):
            raise UserError(f"model.options.{key}={value!r} is not valid (default: {default!r})") from None
    return out


def _stream(options: dict, prefix: str, scale: float) -> StreamGuidance:
    """The audio stream's scales: `audio_<key>` where set, else the video value (LTX2Pipeline's defaulting)."""
    def pick(key: str, video_value: float) -> float:
        value = options.get(f"{prefix}{key}")
        return float(video_value if value is None else value)

    return StreamGuidance(pick("guidance_scale", scale), pick("stg_scale", options["stg_scale"]),
                          pick("modality_scale", options["modality_scale"]),
                          pick("guidance_rescale", options["guidance_rescale"]))


# ----------------------------------------------------------------------------------------------- adapter
@register_model("ltx2")
class LTX2Policy(DiffusersPolicy):
    default_lora_targets = LTX2_LORA_TARGETS
    family = "LTX-2"
    # `model.options` keys and defaults (config validation refuses other keys). Guidance: rollout.guidance_scale is
    # the video CFG scale; an audio_* value of null takes the video one. Defaults turn every extra term off;
    # LTX2Pipeline's own call defaults (LTX-2.3's) are guidance 3 / audio 7, stg 1 at block 28, modality 3, rescale 0.7.
    options = {
        "audio_guidance_scale": None,
        "stg_scale": 0.0,  # spatio-temporal guidance: self-attention skipped in `stg_blocks` (LTX-2.3 layout only)
        "audio_stg_scale": None,
        "stg_blocks": [],  # 0-based block indices (LTX2Pipeline: [28] for LTX-2.3, [29] for LTX-2.0)
        "modality_scale": 1.0,  # modality isolation guidance: the audio↔video attention turned off
        "audio_modality_scale": None,
        "guidance_rescale": 0.0,  # φ of the x0 rescale; 0: off
        "audio_guidance_rescale": None,
        "use_cross_timestep": None,  # null: true for the LTX-2.3 layout (prompt modulation), false for LTX-2.0
        "frame_rate": 24.0,  # the fps the video positions are conditioned on (the model config: ${rollout.fps})
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, COMPONENTS)
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        net = self.load("transformer", self.dtype).to(device)
        self.networks["transformer"] = net
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.audio_vae = frozen(self.load("audio_vae", torch.float32), device)
        self.vocoder = frozen(self.load("vocoder", torch.float32), device)
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.connectors = frozen(self.load("connectors", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        self.tokenizer.padding_side = "left"  # LTX2Pipeline: Gemma prompts are left-padded
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.scheduler = self.load("scheduler")
        self.num_train_timesteps = int(self.scheduler.config.get("num_train_timesteps", 1000))
        self.max_sequence_length = int(cfg.max_sequence_length)
        c = net.config
        self.perturbed_attn = bool(c.get("perturbed_attn", False))
        cross = self.opts["use_cross_timestep"]
        self.use_cross_timestep = bool(c.cross_attn_mod or c.audio_cross_attn_mod) if cross is None else bool(cross)
        self.frame_rate = float(self.opts["frame_rate"])
        self.stg_blocks = [int(i) for i in self.opts["stg_blocks"] or []]
        self._check_guidance_options()
        vc, ac = self.vae.config, self.audio_vae.config
        self.temporal_factor = int(self.vae.temporal_compression_ratio)
        self.spatial_factor = int(self.vae.spatial_compression_ratio)
        self.audio_latents_per_second = ac.sample_rate / ac.mel_hop_length / float(self.audio_vae.temporal_compression_ratio)
        self.latent_mel_bins = ac.mel_bins // self.audio_vae.mel_compression_ratio
        self._video_mean = self.vae.latents_mean.float().view(1, -1, 1, 1, 1)
        self._video_std = self.vae.latents_std.float().view(1, -1, 1, 1, 1)
        self._video_scaling = float(vc.scaling_factor)
        self.sample_rate = int(self.vocoder.config.output_sampling_rate)
        if c.in_channels != vc.latent_channels * c.patch_size_t * c.patch_size**2:
            raise ValueError(f"{self.root}: the transformer takes {c.in_channels} video channels but the VAE makes "
                             f"{vc.latent_channels} (patch {c.patch_size_t}×{c.patch_size}²)")

    def load(self, name: str, dtype: torch.dtype | None = None):
        """Components the way model_index.json names them; LTX-2's connectors and vocoder live in the pipeline's
        own module (library "ltx2": `diffusers.pipelines.ltx2`)."""
        if name not in self.present:
            return None
        library, cls_name = self.present[name]
        if library in ("diffusers", "transformers") or "Tokenizer" in cls_name or "Scheduler" in cls_name:
            return load_component(self.root, name, self.present[name], dtype)
        cls = getattr(importlib.import_module(f"diffusers.pipelines.{library}"), cls_name)
        return cls.from_pretrained(str(self.root / name), **({} if dtype is None else {"torch_dtype": dtype}))

    def _check_guidance_options(self) -> None:
        o = self.opts
        layers = self.transformer.config.num_layers
        bad = [i for i in self.stg_blocks if not 0 <= i < layers]
        if bad:
            raise UserError(f"model.options.stg_blocks={self.stg_blocks}: the transformer has blocks 0..{layers - 1}")
        if self.stg_active() and not self.stg_blocks:
            raise UserError("model.options.stg_scale > 0 needs model.options.stg_blocks (LTX2Pipeline: [28] for "
                            "LTX-2.3)")
        if self.stg_active() and not self.perturbed_attn:
            raise UserError(f"model.options.stg_scale={o['stg_scale']}: this transformer has no perturbed attention "
                            "(perturbed_attn=false, the LTX-2.0 layout), so STG's forward equals the conditional one "
                            "and changes nothing; set stg_scale=0")

    def stream_guidance(self, scale: float) -> dict[str, StreamGuidance]:
        """Per-stream scales for a rollout guidance scale (the video CFG scale)."""
        video = StreamGuidance(float(scale), float(self.opts["stg_scale"]), float(self.opts["modality_scale"]),
                               float(self.opts["guidance_rescale"]))
        return {"video": video, "audio": _stream(self.opts, "audio_", scale)}

    def stg_active(self, scale: float = 1.0) -> bool:
        return any(g.stg > 0 for g in self.stream_guidance(scale).values())

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        tokens = self.tokenizer([text.strip()], padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        out = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(self.dtype)
        video, audio, text_mask = self.connectors(hidden, mask, padding_side=self.tokenizer.padding_side)
        return {"prompt_embeds": video[0].float(), "audio_prompt_embeds": audio[0].float(),
                "prompt_attention_mask": text_mask[0]}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """The negative prompt's conditioning when either stream uses CFG (the video scale is the rollout's)."""
        if all(g.scale == 1.0 for g in self.stream_guidance(guidance.scale).values()):
            return {}
        return self.encode_prompts([guidance.negative_prompt])

    # ------------------------------------------------------------------------------------------- diffusion
    def audio_frames(self, shape: MediaShape) -> int:
        """Latent audio frames for a video of `shape.frames` at `shape.fps`: round(seconds · latents per second)."""
        return round(shape.frames / shape.fps * self.audio_latents_per_second)

    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        c = self.transformer.config
        frames, h, w = video_latent_grid("LTX-2", shape, self.temporal_factor, self.spatial_factor,
                                         (c.patch_size, c.patch_size))
        if shape.fps != self.frame_rate:
            raise ValueError(f"rollout.fps={shape.fps} differs from model.options.frame_rate={self.frame_rate}, the "
                             "rate LTX-2 conditions its video positions on (the model config sets it to rollout.fps)")
        if frames % c.patch_size_t:
            raise ValueError(f"rollout.num_frames={shape.frames} gives {frames} latent frames, not a multiple of the "
                             f"transformer's temporal patch {c.patch_size_t}")
        audio = self.audio_frames(shape)
        if audio < 1:
            raise ValueError(f"rollout.num_frames={shape.frames} at rollout.fps={shape.fps} is too short for one "
                             f"latent audio frame (1/{self.audio_latents_per_second:g} s)")
        return {"video": (self.vae.config.latent_channels, frames, h, w),
                "audio": (self.audio_vae.config.latent_channels, audio, self.latent_mel_bins)}

    def video_tokens(self, video_shape: tuple[int, ...]) -> int:
        c = self.transformer.config
        _, f, h, w = video_shape
        return (f // c.patch_size_t) * (h // c.patch_size) * (w // c.patch_size)

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        return ltx2_sigmas(num_steps, self.video_tokens(self.latent_shapes(shape)["video"]), self.scheduler)

    def forward_flops(self, latents: Latents, cond: Cond, isolate: bool = False, perturbed: bool = False) -> float:
        return ltx2_forward_flops(self.transformer.config, self.video_tokens(latents["video"].shape[1:]),
                                  latents["audio"].shape[2], cond["prompt_embeds"].shape[1], isolate_modalities=isolate,
                                  perturbed_blocks=len(set(self.stg_blocks)) if perturbed and self.perturbed_attn else 0)

    def _forward(self, latents: Latents, sigma: torch.Tensor, cond: Cond, isolate: bool = False,
                 perturbed: bool = False) -> Latents:
        batch = latents["video"].shape[0]
        self.flops += self.forward_flops(latents, cond, isolate, perturbed) * batch * (3 if torch.is_grad_enabled() else 1)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype.itemsize < 4):
            out = self._network_forward(self.transformer, latents, sigma, cond, isolate, perturbed)
        return {k: at_least_float32(v) for k, v in out.items()}

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond, isolate: bool = False,
                         perturbed: bool = False) -> Latents:
        c = network.config
        video, audio = latents["video"], latents["audio"]
        _, _, frames, height, width = video.shape
        timestep = sigma.float() * self.num_train_timesteps  # float32: bf16 would round 1000·σ to ~4 units
        mask = cond["prompt_attention_mask"]
        out_video, out_audio = network(
            hidden_states=pack_video(video, c.patch_size, c.patch_size_t).to(self.dtype),
            audio_hidden_states=pack_audio(audio).to(self.dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            audio_encoder_hidden_states=cond["audio_prompt_embeds"].to(self.dtype),
            timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=frames // c.patch_size_t, height=height // c.patch_size, width=width // c.patch_size,
            fps=self.frame_rate, audio_num_frames=audio.shape[2], isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=self.stg_blocks if perturbed else None,
            use_cross_timestep=self.use_cross_timestep, return_dict=False)
        return {"video": unpack_video(out_video, frames, height, width, c.patch_size, c.patch_size_t),
                "audio": unpack_audio(out_audio, audio.shape[3])}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The guided velocity (module docstring, "Guidance"): one batched forward of negative ⊕ positive prompt for
        CFG, one more for STG and one for modality isolation when their scales turn them on."""
        streams = self.stream_guidance(guidance)
        cfg = bool(shared) and any(g.scale != 1.0 for g in streams.values())
        stg = any(g.stg > 0 for g in streams.values())
        isolate = any(g.modality != 1.0 for g in streams.values())
        rescale = any(g.rescale > 0 for g in streams.values())
        uncond = None
        if cfg:
            both = self._forward({k: torch.cat([v, v]) for k, v in latents.items()}, torch.cat([sigma, sigma]),
                                 self._pair(cond, shared))
            uncond, v_cond = {k: v.chunk(2)[0] for k, v in both.items()}, {k: v.chunk(2)[1] for k, v in both.items()}
        else:
            v_cond = self._forward(latents, sigma, cond)
        if not (cfg or stg or isolate or rescale):
            return v_cond
        perturbed = self._forward(latents, sigma, cond, perturbed=True) if stg else None
        isolated = self._forward(latents, sigma, cond, isolate=True) if isolate else None

        def x0(v: Latents | None, k: str) -> torch.Tensor | None:
            return None if v is None else x0_from_velocity(latents[k], v[k], sigma)

        out = {}
        for k, g in streams.items():
            target = guided_x0(x0(v_cond, k), x0(uncond, k), x0(perturbed, k), x0(isolated, k), g.scale, g.stg,
                               g.modality, g.rescale)
            out[k] = velocity_from_x0(latents[k], target, sigma)
        return out

    # ------------------------------------------------------------------------------------------- media
    def _denormalized_audio(self, audio: torch.Tensor) -> torch.Tensor:
        packed = pack_audio(audio)  # LTX2Pipeline denormalises the packed (B, L, C·M) tokens
        mean, std = self.audio_vae.latents_mean.float(), self.audio_vae.latents_std.float()
        return unpack_audio(packed * std + mean, audio.shape[3])

    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        video = latents["video"].to(self.device, torch.float32)
        z = video * self._video_std / self._video_scaling + self._video_mean
        # a timestep-conditioned VAE decodes at LTX2Pipeline's default decode_timestep 0 (noise scale 0: z itself)
        timestep = torch.zeros(z.shape[0], device=self.device) if self.vae.config.timestep_conditioning else None
        frames = self.vae.decode(z, timestep, return_dict=False)[0]  # (B, 3, T, H, W) in [-1, 1]
        mel = self.audio_vae.decode(self._denormalized_audio(latents["audio"].to(self.device, torch.float32)),
                                    return_dict=False)[0]
        waveform = self.vocoder(mel).float().clamp(-1, 1)
        return {"video": (frames.permute(0, 2, 1, 3, 4).float() / 2 + 0.5).clamp(0, 1),
                "audio": Audio(waveform, self.sample_rate)}

    def encode_media(self, media: Media) -> Latents:
        raise NotImplementedError("LTX-2 cannot encode decoded media back to latents: a waveform would need the "
                                  "audio VAE's mel front end, which diffusers does not ship (offline pairs are not "
                                  "supported for LTX-2)")
