"""Stable Audio Open adapter (a DiT over Oobleck VAE latents, trained as EDM v-prediction), loaded from a local
diffusers `StableAudioPipeline` directory, and sampled by polyrl as flow matching through an exact change of
variables (docs/audio.md, "Stable Audio Open as flow matching").

Facts taken from diffusers' `StableAudioPipeline` (0.42.1) and the checkpoint's `CosineDPMSolverMultistepScheduler`:
- Latents: (B, C, T) with C = the transformer's `in_channels` (64) and T = its `sample_size` (1024) whatever the
  requested length: the pipeline always denoises the whole window and crops the decoded waveform to
  [audio_start_in_s, audio_end_in_s]. The Oobleck VAE has no latent scaling; one latent frame is `hop_length`
  (2048) samples at `sampling_rate` (44.1 kHz): 47.55 s per window.
- Noise: variance exploding, x_σ = x0 + σ·ε, σ from σ_max = 500 down to σ_min = 0.3 (k-diffusion's exponential
  grid, then 0). Preconditioning (EDM, Karras et al. 2022, Table 1, with the cosine scheduler's c_noise):
  c_in = 1/√(σ² + σ_d²), c_noise = atan(σ)·2/π, and the network F predicts v, so
  x̂0 = c_skip·x_σ + c_out·F with c_skip = σ_d²/(σ² + σ_d²), c_out = −σ·σ_d/√(σ² + σ_d²) (σ_d = `sigma_data`, 1).
- Text: T5 on the prompt padded to the tokenizer's `model_max_length`, projected by `projection_model` and
  multiplied by the attention mask. Duration: `projection_model` embeds the start and end seconds as one token each;
  the cross-attention context is [text tokens, start, end] and the global (prepended) token is [start ‖ end].
- Guidance: CFG on F, F_u + s·(F_c − F_u). Without a negative prompt the unconditional context is all zeros (text
  and seconds tokens; the global token keeps the seconds); with one it is the negative prompt's context.
- The network takes the timestep c_noise and RoPE over T + 1 positions (the global token first).

The change of variables: y = x_σ/(1 + σ), s = σ/(1 + σ) turns x0 + σ·ε into y = (1 − s)·x0 + s·ε, the
rectified-flow interpolation, with velocity v = ε − x0 = (y − x̂0)/s. In terms of y and s the model is
`sao_network_input`, `sao_timestep` and `sao_flow_velocity`, exact at every s including s = 1 (σ = ∞), so every
polyrl step (sde, cps, dance: sampling/steps.py) runs on Stable Audio Open unchanged, with its Gaussian log-density.
CFG on F is CFG on v (v is affine in F with a coefficient shared by both halves).

Differences from `StableAudioPipeline`, on purpose:
- The grid is the scheduler's σ grid mapped to s, except its first point σ_max = 500 (s = 0.998), which is taken
  as σ = ∞ (s = 1). The pipeline's initial latents √(σ_max² + 1)·z are 0.998·z in flow coordinates: σ_max is its
  finite stand-in for pure noise. Starting at s = 1 makes polyrl's standard-normal initial latents exact and keeps
  Flow-GRPO's SDE std finite (a·√(s/(1 − s)) is 22·a at s = 0.998); the network sees c_noise = 1 (the end of the
  [0, 1] timestep range it was trained on) instead of 0.9987.
- polyrl's step (Euler / SDE in flow coordinates) replaces the DPM-Solver++(2M) SDE solver.
- `rollout.negative_prompt: ""` means the pipeline's default unconditional (zeros, as `negative_prompt=None`);
  any other text is encoded as the pipeline does with `negative_prompt=<text>`.
"""

from __future__ import annotations

import json
import math

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from ..media import Audio
from .base import Cond, Guidance, Media, Prompt, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .options import read_options

# Self- and cross-attention projections and the SwiGLU feed-forward of every block (diffusers' module names).
SAO_LORA_TARGETS = [
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2",
]
COMPONENTS = ("vae", "text_encoder", "tokenizer", "projection_model", "transformer", "scheduler")


# ----------------------------------------------------------------------------------------------- pure math
def flow_sigma(edm_sigma: torch.Tensor) -> torch.Tensor:
    """s = σ/(1 + σ): the flow-matching noise level of the EDM level σ (σ = ∞ ↦ 1, 0 ↦ 0)."""
    return torch.where(torch.isinf(edm_sigma), torch.ones_like(edm_sigma), edm_sigma / (1 + edm_sigma))


def _radius(s: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """r = √(s² + σ_d²(1 − s)²) = (1 − s)·√(σ² + σ_d²): the std of y given x0 ~ (0, σ_d²), and c_in = 1/r·(1 − s)."""
    return torch.sqrt(s**2 + sigma_data**2 * (1 - s) ** 2)


def sao_network_input(y: torch.Tensor, s: torch.Tensor, sigma_data: float = 1.0) -> torch.Tensor:
    """c_in·x_σ in flow coordinates: x_σ = y/(1 − s), c_in = 1/√(σ² + σ_d²), so c_in·x_σ = y / r (`_radius`).
    `s` is (B,) (or a scalar); defined at s = 1."""
    s = torch.as_tensor(s, dtype=y.dtype, device=y.device)
    return y / _radius(s, sigma_data).view(-1, *([1] * (y.dim() - 1)))


def sao_timestep(s: torch.Tensor) -> torch.Tensor:
    """c_noise = atan(σ)·2/π of the cosine scheduler, written as atan2(s, 1 − s)·2/π (σ = s/(1 − s)): 1 at s = 1."""
    return torch.atan2(s, 1 - s) * (2 / math.pi)


def sao_flow_velocity(y: torch.Tensor, model_output: torch.Tensor, s: torch.Tensor,
                      sigma_data: float = 1.0) -> torch.Tensor:
    """The flow velocity v = ε̂ − x̂0 = (y − x̂0)/s of a v-prediction F at flow level s (docs/audio.md):

        x̂0 = c_skip·x_σ + c_out·F = σ_d²(1 − s)/r²·y − s·σ_d/r·F,  so  v = (s − σ_d²(1 − s))/r²·y + σ_d/r·F,

    with r = √(s² + σ_d²(1 − s)²). Exact for s in (0, 1] (the division by s cancels); CFG on F is CFG on v."""
    s = torch.as_tensor(s, dtype=y.dtype, device=y.device).view(-1, *([1] * (y.dim() - 1)))
    r2 = s**2 + sigma_data**2 * (1 - s) ** 2
    return (s - sigma_data**2 * (1 - s)) / r2 * y + sigma_data / torch.sqrt(r2) * model_output


def edm_sigmas(num_steps: int, sigma_min: float, sigma_max: float, schedule: str = "exponential",
               rho: float = 7.0) -> torch.Tensor:
    """The scheduler's N EDM levels from σ_max to σ_min (float32), as `CosineDPMSolverMultistepScheduler.
    set_timesteps`: exponential = exp(linspace(log σ_max, log σ_min, N)) (k-diffusion's `get_sigmas_exponential`),
    karras = (σ_max^(1/ρ) + u·(σ_min^(1/ρ) − σ_max^(1/ρ)))^ρ for u = linspace(0, 1, N) (Karras et al. 2022, eq. 5)."""
    if schedule == "exponential":
        return torch.linspace(math.log(sigma_min), math.log(sigma_max), num_steps).exp().flip(0)
    if schedule == "karras":
        ramp = torch.linspace(0, 1, num_steps)
        lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
        return (hi + ramp * (lo - hi)) ** rho
    raise ValueError(f"sigma_schedule={schedule!r}; allowed: exponential, karras")


def sao_sigmas(num_steps: int, sigma_min: float, sigma_max: float, schedule: str = "exponential",
               rho: float = 7.0) -> torch.Tensor:
    """polyrl's flow grid for Stable Audio Open: [1, s(σ_1), …, s(σ_{N−1}), 0], float32 (module docstring: σ_0 =
    σ_max is taken as ∞)."""
    edm = edm_sigmas(num_steps, sigma_min, sigma_max, schedule, rho).double()
    edm[0] = math.inf
    return torch.cat([flow_sigma(edm), torch.zeros(1, dtype=torch.float64)]).float()


def sao_forward_flops(config, latent_frames: int, context_tokens: int) -> float:
    """`StableAudioDiTModel`, one sample with T = `latent_frames` latent frames and `context_tokens` cross-attention
    tokens (text + 2 seconds tokens) (docs/algorithms.md §6: a matmul is 2·tokens·in·out, attention 4·Sq·Sk·d).

    n = T + 1 tokens (the global token prepended), d = heads·head_dim, kv = kv_heads·head_dim, c the
    cross-attention width. Per block: self-attention q/k/v/out (8·n·d²) + 4·n²·d; cross-attention q and out on n
    (4·n·d²), k and v on the context (4·L·c·kv) + 4·n·L·d; SwiGLU feed-forward d → 2·4d, 4d → d (24·n·d²).
    Outside: the cross-attention projection (2·L·(c_in·c + c²)), the global projection and the timestep projection
    (one token each), the 1×1 pre/post convolutions (2·T·C² each), proj_in (2·T·C·d) and proj_out (2·n·d·C, the
    global token included)."""
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    kv = c.num_key_value_attention_heads * c.attention_head_dim
    cross, t, n, ctx = c.cross_attention_dim, latent_frames, latent_frames + 1, context_tokens
    per_block = 2 * n * 4 * d * d + 4 * n * n * d  # self-attention
    per_block += 2 * n * 2 * d * d + 2 * ctx * 2 * cross * kv + 4 * n * ctx * d  # cross-attention
    per_block += 2 * n * (d * 8 * d + 4 * d * d)  # SwiGLU feed-forward (inner 4d)
    flops = c.num_layers * per_block
    flops += 2 * ctx * (c.cross_attention_input_dim * cross + cross * cross)
    flops += 2 * (c.global_states_input_dim * d + d * d) + 2 * (c.time_proj_dim * d + d * d)
    flops += 2 * 2 * t * c.in_channels * c.in_channels  # preprocess_conv (C_in) and postprocess_conv (C_out = C_in)
    flops += 2 * t * c.in_channels * d + 2 * n * d * c.out_channels
    return float(flops)


def with_peft(network: torch.nn.Module) -> torch.nn.Module:
    """The network with diffusers' `PeftAdapterMixin` (add_adapter, enable/disable_adapters), which
    `StableAudioDiTModel` and `StableAudio3DiTModel` lack: the loaded instance's class gains the mixin (same weights,
    same forward), so the actor adds LoRA to it as to any diffusers transformer."""
    from diffusers.loaders import PeftAdapterMixin

    if not isinstance(network, PeftAdapterMixin):
        cls = type(network)
        network.__class__ = type(cls.__name__, (cls, PeftAdapterMixin), {"__module__": cls.__module__})
    return network


# ----------------------------------------------------------------------------------------------- adapter
@register_model("stable_audio")
class StableAudioOpenPolicy(DiffusersPolicy):
    default_lora_targets = SAO_LORA_TARGETS
    family = "Stable Audio Open"
    # `model.options` keys and defaults (config validation refuses other keys)
    options = {
        "seconds": None,  # audio_end_in_s; null: the whole window (transformer sample_size · hop / rate: 47.55 s)
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, COMPONENTS)
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.networks["transformer"] = with_peft(self.load("transformer", self.dtype).to(device))
        self.vae = frozen(self.load("vae", torch.float32), device)
        text_dtype = torch.bfloat16 if self.dtype == torch.float16 else self.dtype  # T5 overflows in float16
        self.text_encoder = frozen(self.load("text_encoder", text_dtype), device)
        self.projection = frozen(self.load("projection_model", torch.float32), device)
        self.tokenizer = self.load("tokenizer")
        sched = json.loads((self.root / "scheduler" / "scheduler_config.json").read_text())
        self.scheduler_config = sched  # read as JSON: the scheduler class itself needs torchsde, its math is ours
        if sched.get("_class_name") != "CosineDPMSolverMultistepScheduler" or sched.get(
                "prediction_type", "v_prediction") != "v_prediction":
            raise UserError(f"{self.root}/scheduler: a {sched.get('_class_name')} with prediction_type="
                            f"{sched.get('prediction_type')!r}; the Stable Audio Open adapter reproduces "
                            "CosineDPMSolverMultistepScheduler with v_prediction (Stable Audio Open 1.0's)")
        self.sigma_data = float(sched.get("sigma_data", 1.0))
        net = self.transformer
        self.sample_rate = int(self.vae.config.sampling_rate)
        self.hop = int(self.vae.hop_length)
        self.window_seconds = net.config.sample_size * self.hop / self.sample_rate
        seconds = self.opts["seconds"]
        self.seconds = self.window_seconds if seconds is None else float(seconds)
        p = self.projection.config
        if not 0 < self.seconds <= min(self.window_seconds, p.max_value):
            raise UserError(f"model.options.seconds={self.seconds:g} must be in (0, {min(self.window_seconds, p.max_value):g}] "
                            f"(the window is {self.window_seconds:g} s, the duration conditioning's maximum {p.max_value})")
        if net.config.in_channels != self.vae.config.decoder_input_channels:
            raise ValueError(f"{self.root}: the transformer takes {net.config.in_channels} channels but the VAE "
                             f"makes {self.vae.config.decoder_input_channels}")
        with torch.no_grad():  # audio_start_in_s = 0, audio_end_in_s = seconds: one token each
            out = self.projection(start_seconds=torch.zeros(1, device=device),
                                  end_seconds=torch.full((1,), self.seconds, device=device))
        self._seconds_tokens = torch.cat([out.seconds_start_hidden_states, out.seconds_end_hidden_states], 1).float()
        self._global = torch.cat([out.seconds_start_hidden_states, out.seconds_end_hidden_states], 2).float()
        self._rope: dict[int, tuple] = {}

    def load(self, name: str, dtype: torch.dtype | None = None):
        """`projection_model` lives in the pipeline's own module (model_index.json's library "stable_audio")."""
        if name != "projection_model":
            return super().load(name, dtype)
        from diffusers.pipelines.stable_audio import StableAudioProjectionModel

        return StableAudioProjectionModel.from_pretrained(str(self.root / name), torch_dtype=dtype)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        tokens = self.tokenizer([text], padding="max_length", max_length=self.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, attention_mask=mask)[0].float()
        text = self.projection(text_hidden_states=hidden).text_hidden_states * mask.unsqueeze(-1).float()
        return {"context": torch.cat([text, self._seconds_tokens], 1)[0]}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """CFG's unconditional context: zeros for the empty negative prompt (the pipeline's `negative_prompt=None`),
        else the negative prompt's context (the pipeline's `negative_prompt=<text>`)."""
        if guidance.scale == 1.0:
            return {}
        if guidance.negative_prompt == "":
            context = self.encode_prompts([""])["context"]
            return {"context": torch.zeros_like(context)}
        return self.encode_prompts([guidance.negative_prompt])

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        if shape.seconds and abs(shape.seconds - self.seconds) > 1e-6:
            raise ValueError(f"Stable Audio Open conditions on its duration: set model.options.seconds={shape.seconds:g} "
                             f"(the adapter was built for {self.seconds:g} s)")
        c = self.transformer.config
        return {"x": (c.in_channels, c.sample_size)}

    def sigmas(self, num_steps: int, shape: MediaShape | None = None) -> torch.Tensor:
        s = self.scheduler_config
        return sao_sigmas(num_steps, float(s.get("sigma_min", 0.3)), float(s.get("sigma_max", 500.0)),
                          s.get("sigma_schedule", "exponential"), float(s.get("rho", 7.0)))

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        return sao_forward_flops(self.transformer.config, latents["x"].shape[-1], cond["context"].shape[1])

    def _rotary(self, positions: int, device) -> tuple:
        """StableAudioPipeline's RoPE over the latent frames + the global token (half the head dim rotates)."""
        if positions not in self._rope:
            from diffusers.models.embeddings import get_1d_rotary_pos_embed

            dim = self.transformer.config.attention_head_dim // 2
            self._rope[positions] = get_1d_rotary_pos_embed(dim, positions, use_real=True, repeat_interleave_real=False)
        return tuple(t.to(device) for t in self._rope[positions])

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        y = latents["x"].float()
        s = sigma.float()
        u = sao_network_input(y, s, self.sigma_data).to(self.dtype)
        b = y.shape[0]
        out = network(u, sao_timestep(s), encoder_hidden_states=cond["context"].to(self.dtype),
                      global_hidden_states=self._global.expand(b, -1, -1).to(self.dtype),
                      rotary_embedding=self._rotary(y.shape[-1] + 1, y.device), return_dict=False)[0]
        return {"x": sao_flow_velocity(y, out.float(), s, self.sigma_data)}

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        """The VAE's waveform of the window, cropped to [0, seconds) as the pipeline crops it, clamped to [−1, 1]."""
        x = latents["x"].to(self.device, torch.float32)
        audio = self.vae.decode(x).sample[:, :, : int(self.seconds * self.sample_rate)]
        return {"audio": Audio(audio.float().clamp(-1, 1), self.sample_rate)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        """A waveform at the VAE's rate, zero-padded (or cut) to the window -> the posterior mean latents."""
        audio = media["audio"]
        if audio.sample_rate != self.sample_rate:
            raise ValueError(f"Stable Audio Open encodes audio at {self.sample_rate} Hz, got {audio.sample_rate} Hz")
        wave = audio.waveform.to(self.device, torch.float32)
        window = self.transformer.config.sample_size * self.hop
        padded = wave.new_zeros(wave.shape[0], self.vae.config.audio_channels, window)
        padded[:, :, : min(window, wave.shape[-1])] = wave[:, :, :window]
        return {"x": self.vae.encode(padded).latent_dist.mean}

