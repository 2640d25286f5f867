"""Stable Audio 3 adapter (a rectified-flow DiT over SAME autoencoder latents), loaded from a local diffusers
`StableAudio3Pipeline` directory.

Facts taken from diffusers' `StableAudio3Pipeline` (0.42.1), which this adapter reproduces:
- Latents: (B, C, T) with C = the SAME VAE's `latent_dim` (256) and T = ⌈(duration + silence padding)·rate /
  ratio⌉, ratio = the VAE's `downsampling_ratio` (patch_size · Π strides); no latent scaling. The decoded waveform is
  cut to duration·rate samples and clamped to [−1, 1].
- Noise: rectified flow x_σ = (1 − σ)·x0 + σ·ε, the network predicts v = ε − x0 and takes the timestep
  σ·`num_train_timesteps` of the checkpoint's FlowMatchEulerDiscreteScheduler (the DiT expects [0, 1]).
- Grid: log-SNR warped (`sa3_logsnr_sigmas`): σ_i = sigmoid(−λ_i), λ = λ_max − u·(λ_max − λ_min) on
  u = linspace(1, 0, N + 1), σ_0 forced to 1, then through the scheduler's `set_timesteps(sigmas=…)` (its shift,
  if any) with the terminal 0. Defaults λ_min = −6.2, λ_max = 2.0.
- Text: T5Gemma on the prompt padded to min(tokenizer max, 256); the duration embedding (`duration_embedder`) is
  both the global (AdaLN) input and one more context token after the text (mask 1). Padded text positions are
  replaced by the DiT's learned padding embedding inside the network.
- Guidance: the distilled checkpoint (SA3 Medium) takes none (scale 1). The base checkpoint takes CFG in velocity
  space, v_u + s·(v_c − v_u), with the negative prompt's context ("" when none is given).
- The distilled checkpoint's own sampler (`stochastic_sampling=True`, "ping-pong"): x̂0 = x − σ·v, x' = (1 − σ')·x̂0 +
  σ'·ε. That is polyrl's `cps` step at noise level a = 1 (std σ'·sin(π/2) = σ', no ε̂ term), so
  `rollout.step=cps rollout.noise_level=1.0 rollout.sde_window_size=0` samples exactly the production distribution,
  with a Gaussian log-density at every step (tests/test_stable_audio3.py checks it against the scheduler's step).
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from ..media import Audio
from .base import Cond, Media, Prompt, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .options import read_options
from .stable_audio import with_peft

# Self- and cross-attention projections (fused q/k/v: differential attention) and the SwiGLU feed-forward.
SA3_LORA_TARGETS = ["self_attn.to_qkv", "self_attn.to_out", "cross_attn.to_q", "cross_attn.to_kv",
                    "cross_attn.to_out", "ff.proj_in", "ff.proj_out"]
COMPONENTS = ("vae", "text_encoder", "tokenizer", "duration_embedder", "transformer", "scheduler")
MAX_TEXT_TOKENS = 256  # StableAudio3Pipeline caps T5Gemma's input at 256 tokens (the reference checkpoint's)


def sa3_logsnr_sigmas(num_steps: int, logsnr_min: float, logsnr_max: float) -> torch.Tensor:
    """The pipeline's N grid points before the scheduler: σ_i = sigmoid(−λ_i), λ_i = λ_max − u_i·(λ_max − λ_min),
    u = linspace(1, 0, N + 1), σ_0 = 1, the terminal point dropped (`logsnr_sigma_schedule` with σ_max = 1)."""
    u = torch.linspace(1.0, 0.0, num_steps + 1)
    sigmas = torch.sigmoid(-(logsnr_max - u * (logsnr_max - logsnr_min)))
    sigmas[0] = 1.0
    return sigmas[:-1]


def sa3_forward_flops(config, latent_frames: int, context_tokens: int) -> float:
    """`StableAudio3DiTModel`, one sample with T latent frames and L context tokens (text + the duration token)
    (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·Sq·Sk·d).

    n = T/p + M tokens (M memory tokens), d = embed_dim, k = 2 attention maps with differential attention, else 1.
    Per block: self-attention to_qkv (2·n·d·(2k + 1)d), k attentions (4·n²·d each), to_out (2·n·d²); cross-attention
    to_q (2·n·d·kd), to_kv on the projected context (2·L·d·(k + 1)d), k attentions (4·n·L·d each), to_out
    (2·n·d²); SwiGLU d → 2i, i → d with i = ff_mult·d (6·n·d·i). Outside: the timestep,
    global and AdaLN (d → 6d) embedders once per sample, the context projection on L tokens, the 1×1 convolutions
    (2·T·C² each), proj_in and proj_out on the T/p latent tokens (2·(T/p)·C·p·d each)."""
    c = config
    d, k = c.embed_dim, 2 if c.use_differential_attention else 1
    inner = int(d * c.ff_mult)
    tokens = latent_frames // c.patch_size
    n, ctx, ch = tokens + c.num_memory_tokens, context_tokens, c.io_channels
    per_block = 2 * n * d * (2 * k + 1) * d + k * 4 * n * n * d + 2 * n * d * d  # self-attention
    per_block += 2 * n * d * k * d + 2 * ctx * d * (k + 1) * d + k * 4 * n * ctx * d + 2 * n * d * d  # cross
    per_block += 2 * n * (d * 2 * inner + inner * d)  # SwiGLU feed-forward
    flops = c.depth * per_block
    flops += 2 * (c.timestep_features_dim * d + d * d) + 2 * (c.global_cond_dim * d + d * d)
    flops += 2 * (d * d + d * 6 * d)  # AdaLN modulation
    flops += 2 * ctx * (c.cond_token_dim * d + d * d)
    flops += 2 * 2 * latent_frames * ch * ch + 2 * 2 * tokens * ch * c.patch_size * d
    return float(flops)


@register_model("stable_audio_3")
class StableAudio3Policy(DiffusersPolicy):
    default_lora_targets = SA3_LORA_TARGETS
    family = "Stable Audio 3"
    # `model.options` keys and defaults: StableAudio3Pipeline's call defaults (config validation refuses other keys)
    options = {
        "seconds": 10.0,  # `duration`: the length conditioned on and decoded
        "logsnr_min": -6.2,  # the grid's log-SNR at the high-noise end
        "logsnr_max": 2.0,  # ... and at the low-noise end
        "silence_padding_seconds": 0.0,  # `silence_padding_duration`: extra latent frames, cut after decoding
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, COMPONENTS)
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.networks["transformer"] = with_peft(self.load("transformer", self.dtype).to(device))
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.duration_embedder = frozen(self.load("duration_embedder", torch.float32), device)
        self.tokenizer = self.load("tokenizer")
        self.scheduler = self.load("scheduler")
        self.num_train_timesteps = float(self.scheduler.config.get("num_train_timesteps", 1))
        self.seconds = float(self.opts["seconds"])
        self.padding_seconds = float(self.opts["silence_padding_seconds"])
        if self.seconds <= 0 or self.padding_seconds < 0:
            raise UserError(f"model.options.seconds={self.seconds:g} must be > 0 and silence_padding_seconds="
                            f"{self.padding_seconds:g} >= 0")
        self.sample_rate = int(self.vae.config.sampling_rate)
        self.ratio = int(self.vae.downsampling_ratio)
        if self.transformer.config.io_channels != self.vae.config.latent_dim:
            raise ValueError(f"{self.root}: the transformer takes {self.transformer.config.io_channels} channels but "
                             f"the VAE makes {self.vae.config.latent_dim}")
        with torch.no_grad():
            self._global = self.duration_embedder(torch.tensor([self.seconds], device=device)).float()  # (1, D)

    def load(self, name: str, dtype: torch.dtype | None = None):
        """`duration_embedder` lives in the pipeline's own module (model_index.json's library "stable_audio_3")."""
        if name != "duration_embedder":
            return super().load(name, dtype)
        from diffusers.pipelines.stable_audio_3 import StableAudio3DurationEmbedder

        return StableAudio3DurationEmbedder.from_pretrained(str(self.root / name), torch_dtype=dtype)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        length = min(getattr(self.tokenizer, "model_max_length", MAX_TEXT_TOKENS), MAX_TEXT_TOKENS)
        tokens = self.tokenizer([text], padding="max_length", max_length=length, truncation=True,
                                return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, attention_mask=mask)[0][0].float()
        return {"context": torch.cat([hidden, self._global.to(hidden.dtype)]),  # (L + 1, D): text, duration
                "context_mask": torch.cat([mask[0], mask.new_ones(1)])}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_frames(self) -> int:
        """⌈(duration + padding)·rate / ratio⌉ latent frames (the pipeline rounds the samples up to whole frames)."""
        return math.ceil((self.seconds + self.padding_seconds) * self.sample_rate / self.ratio)

    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        if shape.seconds and abs(shape.seconds - self.seconds) > 1e-6:
            raise ValueError(f"Stable Audio 3 conditions on its duration: set model.options.seconds={shape.seconds:g} "
                             f"(the adapter was built for {self.seconds:g} s)")
        frames = self.latent_frames()
        if frames % self.transformer.config.patch_size:
            raise ValueError(f"model.options.seconds={self.seconds:g} gives {frames} latent frames, not a multiple of "
                             f"the transformer's patch size {self.transformer.config.patch_size}")
        return {"x": (self.vae.config.latent_dim, frames)}

    def sigmas(self, num_steps: int, shape: MediaShape | None = None) -> torch.Tensor:
        """The pipeline's grid: `sa3_logsnr_sigmas` through the checkpoint scheduler's `set_timesteps(sigmas=…)`."""
        grid = sa3_logsnr_sigmas(num_steps, self.opts["logsnr_min"], self.opts["logsnr_max"])
        self.scheduler.set_timesteps(sigmas=grid.tolist())
        return self.scheduler.sigmas.float().cpu()

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        return sa3_forward_flops(self.transformer.config, latents["x"].shape[-1], cond["context"].shape[1])

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        b = latents["x"].shape[0]
        out = network(latents["x"].to(self.dtype), sigma.float() * self.num_train_timesteps,
                      encoder_hidden_states=cond["context"].to(self.dtype),
                      global_hidden_states=self._global.expand(b, -1).to(self.dtype),
                      encoder_attention_mask=cond["context_mask"], return_dict=False)[0]
        return {"x": out}

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        audio = self.vae.decode(latents["x"].to(self.device, torch.float32)).sample
        audio = audio[:, :, : int(self.seconds * self.sample_rate)].clamp(-1, 1)
        return {"audio": Audio(audio.float(), self.sample_rate)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        """A waveform at the VAE's rate, zero-padded (or cut) to the latent frames' samples -> the SAME latents."""
        audio = media["audio"]
        if audio.sample_rate != self.sample_rate:
            raise ValueError(f"Stable Audio 3 encodes audio at {self.sample_rate} Hz, got {audio.sample_rate} Hz")
        wave = audio.waveform.to(self.device, torch.float32)
        length = self.latent_frames() * self.ratio
        padded = wave.new_zeros(wave.shape[0], self.vae.config.audio_channels, length)
        padded[:, :, : min(length, wave.shape[-1])] = wave[:, :, :length]
        return {"x": self.vae.encode(padded).latents}
