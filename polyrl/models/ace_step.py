"""ACE-Step 1.5 text-to-music adapter (a flow-matching DiT over Oobleck VAE latents, conditioned on a caption, lyrics
and a timbre reference), loaded from a local diffusers `AceStepPipeline` directory.

Facts taken from diffusers' `AceStepPipeline` (0.42.1), text2music task, which this adapter reproduces:
- Latents: (B, T, C) with C = the transformer's `audio_acoustic_hidden_dim` (64) and T = ⌈seconds·rate / hop⌉ (hop =
  Π of the VAE's `downsampling_ratios`: 25 latent frames per second at 48 kHz). The decoded waveform is peak-normalised
  (divided by its peak when that exceeds 1, then scaled to a −1 dBFS peak), per clip.
- Noise: rectified flow x_σ = (1 − σ)·x0 + σ·ε; the network predicts v and takes timestep = timestep_r = σ (the
  scheduler has num_train_timesteps = 1). Grid: σ = s·u/(1 + (s − 1)·u) on u = linspace(1, 0, N + 1) with the
  shift s (`model.shift`; the pipeline's default 3.0; the turbo checkpoints' 8-step tables are this formula).
- Conditioning: the caption in ACE-Step's SFT template (instruction, caption, metadata with the duration) through the
  Qwen3 text encoder, the lyrics (`"# Languages\\n{lang}\\n\\n# Lyric\\n{lyrics}<|endoftext|>"`) through its token
  embeddings only, and the timbre of the condition encoder's `silence_latent` (no reference audio), packed by
  `AceStepConditionEncoder` into one cross-attention sequence. The DiT also reads `context_latents` = the silence
  latent over T frames ‖ a chunk mask of ones (generate everywhere).
- Guidance: turbo checkpoints (`is_turbo`) are guidance-distilled (scale 1). Base / SFT checkpoints use APG against the
  learned `null_condition_emb` (broadcast over the sequence) inside a σ interval: `ace_apg` below.

Differences from `AceStepPipeline`, on purpose:
- APG's momentum buffer (−0.75, carried across steps) is not kept: it makes the guided velocity depend on the previous
  steps' differences, so a transition would not be a function of (x, σ) and its log-prob could not be recomputed in
  training. Without momentum APG equals the pipeline's at the first guided step and differs after it.
- The cross-attention sees each prompt's own sequence: prompts are encoded one at a time (the pipeline pads a batch
  to its longest prompt and the DiT attends to the padding, so a prompt's audio depends on its batch). A batch of
  prompts of different lengths runs one forward per length (`_forward`).
- Only text2music; lyrics, language and metadata are model options shared by every prompt.
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from ..media import Audio
from .base import Cond, Guidance, Media, Prompt, register_model, text_only
from .diffusers_base import DiffusersPolicy, frozen
from .options import read_options

# Self- and cross-attention projections and the gated MLP of every DiT layer (diffusers' module names).
ACE_LORA_TARGETS = [
    "self_attn.to_q", "self_attn.to_k", "self_attn.to_v", "self_attn.to_out.0",
    "cross_attn.to_q", "cross_attn.to_k", "cross_attn.to_v", "cross_attn.to_out.0",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]
COMPONENTS = ("vae", "text_encoder", "tokenizer", "transformer", "condition_encoder", "scheduler")
PEAK_DBFS = -1.0  # the pipeline's output loudness: peak at −1 dBFS
APG_NORM_THRESHOLD = 2.5  # AceStepPipeline: normalized_guidance(norm_threshold=2.5, eta=0)


# ----------------------------------------------------------------------------------------------- pure math
def ace_apg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float,
            norm_threshold: float = APG_NORM_THRESHOLD) -> torch.Tensor:
    """Adaptive projected guidance as ACE-Step runs it (Sadat et al. 2024, "Eliminating Oversaturation and Artifacts
    of High Guidance Scales in Diffusion Models", with η = 0 and no momentum; docs/audio.md), over the time axis of
    (B, T, C):

        Δ = v_c − v_u,  Δ ← Δ·min(1, τ/‖Δ‖_T),  Δ⊥ = Δ − ⟨Δ, v̂_c⟩_T·v̂_c  (v̂_c = v_c/‖v_c‖_T),  v = v_c + (s − 1)·Δ⊥,

    norms and the projection per sample and channel over T, in float64 (as diffusers computes the projection)."""
    diff = (v_cond - v_uncond).double()
    norm = diff.norm(p=2, dim=1, keepdim=True)
    diff = diff * torch.minimum(torch.ones_like(norm), norm_threshold / norm)
    unit = torch.nn.functional.normalize(v_cond.double(), dim=1)
    orthogonal = diff - (diff * unit).sum(1, keepdim=True) * unit
    return (v_cond.double() + (scale - 1) * orthogonal).to(v_cond.dtype)


def ace_peak_normalize(audio: torch.Tensor, dbfs: float = PEAK_DBFS) -> torch.Tensor:
    """(B, channels, samples): divided by its peak where the peak exceeds 1, then scaled to a peak of 10^(dbfs/20)."""
    peak = audio.abs().amax(dim=(1, 2), keepdim=True)
    audio = audio / peak.clamp(min=1.0)
    return audio * (10.0 ** (dbfs / 20.0) / audio.abs().amax(dim=(1, 2), keepdim=True).clamp(min=1e-6))


def ace_forward_flops(config, latent_frames: int, context_tokens: int) -> float:
    """`AceStepTransformer1DModel`, one sample with T latent frames and L condition tokens (docs/algorithms.md §6: a
    matmul is 2·tokens·in·out, attention 4·Sq·Sk·(heads·head_dim)).

    n = ⌈T/p⌉ patch tokens, d = hidden_size, q = heads·head_dim, kv = kv_heads·head_dim, I = intermediate_size.
    Per layer: self-attention q/k/v/out (2n·(2dq + 2d·kv)) + 4n²q (sliding-window layers run dense attention with a
    band mask, so they execute the full n²); cross-attention q and out on n, k and v on L (2n·2dq + 2L·2d·kv) + 4nLq;
    the gated MLP (2n·3dI). Outside: the two timestep embedders (256 → d → d → 6d each, once per sample), the
    condition projection (2L·E·d, E = encoder_hidden_size), the patchify Conv1d (2n·d·C_in·p) and the transposed
    Conv1d back (2·n·p·C·d)."""
    c = config
    d, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv, p = c.num_key_value_heads * c.head_dim, c.patch_size
    n, ctx = math.ceil(latent_frames / p), context_tokens
    enc = c.encoder_hidden_size or d
    per_layer = 2 * n * (2 * d * q + 2 * d * kv) + 4 * n * n * q  # self-attention
    per_layer += 2 * n * 2 * d * q + 2 * ctx * 2 * d * kv + 4 * n * ctx * q  # cross-attention
    per_layer += 2 * n * 3 * d * c.intermediate_size  # gated MLP
    flops = c.num_hidden_layers * per_layer
    flops += 2 * 2 * (256 * d + d * d + d * 6 * d)  # time_embed and time_embed_r
    flops += 2 * ctx * enc * d + 2 * n * d * c.in_channels * p + 2 * n * p * c.audio_acoustic_hidden_dim * d
    return float(flops)


# ----------------------------------------------------------------------------------------------- adapter
@register_model("ace_step")
class AceStepPolicy(DiffusersPolicy):
    default_lora_targets = ACE_LORA_TARGETS
    family = "ACE-Step"
    # `model.options` keys and defaults: AceStepPipeline's call defaults (config validation refuses other keys)
    options = {
        "seconds": 60.0,  # `audio_duration` (also written into the caption's metadata, as whole seconds)
        "lyrics": "",  # every prompt's lyrics ("" : none, as the pipeline's default)
        "vocal_language": "en",
        "bpm": None,  # metadata; null: "N/A"
        "keyscale": "",
        "timesignature": "",
        "cfg_interval_start": 0.0,  # APG applies where 1 − σ is in [start, end]
        "cfg_interval_end": 1.0,
    }

    def __init__(self, cfg, device: torch.device):
        super().__init__(cfg, device, COMPONENTS)
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.networks["transformer"] = self.load("transformer", self.dtype).to(device)
        self.vae = frozen(self.load("vae", torch.float32), device)
        self.text_encoder = frozen(self.load("text_encoder", self.dtype), device)
        self.condition_encoder = frozen(self.load("condition_encoder", self.dtype), device)
        self.tokenizer = self.load("tokenizer")
        shift = getattr(cfg, "shift", None)
        self.shift = 3.0 if shift is None else float(shift)  # AceStepPipeline's default shift
        c = self.transformer.config
        self.is_turbo = bool(c.get("is_turbo", False) or c.get("model_version") == "turbo")
        self.sample_rate = int(self.vae.config.sampling_rate)
        self.hop = math.prod(self.vae.config.downsampling_ratios)
        self.latents_per_second = self.sample_rate / self.hop
        self.seconds = float(self.opts["seconds"])
        if self.seconds <= 0:
            raise UserError(f"model.options.seconds={self.seconds:g} must be > 0")
        if self.vae.config.decoder_input_channels != c.audio_acoustic_hidden_dim:
            raise ValueError(f"{self.root}: the transformer makes {c.audio_acoustic_hidden_dim} channels but the VAE "
                             f"decodes {self.vae.config.decoder_input_channels}")
        self.frames = math.ceil(self.seconds * self.latents_per_second)
        silence = self.condition_encoder.silence_latent.float()  # (1, T_long, C): the VAE latent of silence
        self._timbre = silence[:, : math.ceil(30 * self.latents_per_second)]  # the pipeline's 30 s reference
        repeats = math.ceil(self.frames / silence.shape[1])
        source = silence.repeat(1, repeats, 1)[:, : self.frames]
        self._context_latents = torch.cat([source, torch.ones_like(source)], -1)  # silence ‖ chunk mask (1, T, 2C)

    def load(self, name: str, dtype: torch.dtype | None = None):
        """`condition_encoder` lives in the pipeline's own module (model_index.json's library "ace_step")."""
        if name != "condition_encoder":
            return super().load(name, dtype)
        from diffusers.pipelines.ace_step import AceStepConditionEncoder

        return AceStepConditionEncoder.from_pretrained(str(self.root / name), torch_dtype=dtype)

    # ------------------------------------------------------------------------------------------- prompts
    def format_prompt(self, text: str) -> tuple[str, str]:
        """(caption in the SFT template, lyrics in their template), as `AceStepPipeline._format_prompt` for text2music."""
        from diffusers.pipelines.ace_step.pipeline_ace_step import SFT_GEN_PROMPT, TASK_INSTRUCTIONS, AceStepPipeline

        o = self.opts
        bpm = None if o["bpm"] is None else int(o["bpm"])
        metas = AceStepPipeline._build_metadata_string(bpm=bpm, keyscale=o["keyscale"],
                                                       timesignature=o["timesignature"], audio_duration=self.seconds)
        caption = SFT_GEN_PROMPT.format(TASK_INSTRUCTIONS["text2music"], text, metas)
        return caption, f"# Languages\n{o['vocal_language']}\n\n# Lyric\n{o['lyrics']}<|endoftext|>"

    def _encode_one(self, prompt: Prompt) -> Cond:
        (text,) = text_only([prompt], self.family)
        caption, lyrics = self.format_prompt(text)
        t = self.tokenizer([caption], truncation=True, max_length=256, return_tensors="pt")
        ly = self.tokenizer([lyrics], truncation=True, max_length=2048, return_tensors="pt")
        text_ids, lyric_ids = t.input_ids.to(self.device), ly.input_ids.to(self.device)
        hidden = self.text_encoder(input_ids=text_ids).last_hidden_state
        lyric_embeds = self.text_encoder.get_input_embeddings()(lyric_ids)
        timbre = self._timbre.to(self.device, hidden.dtype)
        states, _ = self.condition_encoder(
            text_hidden_states=hidden, text_attention_mask=t.attention_mask.to(self.device).bool(),
            lyric_hidden_states=lyric_embeds, lyric_attention_mask=ly.attention_mask.to(self.device).bool(),
            refer_audio_acoustic_hidden_states_packed=timbre,
            refer_audio_order_mask=torch.zeros(1, dtype=torch.long, device=self.device))
        return {"context": states[0].float(), "context_len": torch.tensor(states.shape[1], device=self.device)}

    def _collate(self, conds: list[Cond]) -> Cond:
        """Contexts zero-padded to the longest; `context_len` says how much of each is the prompt's (`_forward`)."""
        longest = max(int(c["context_len"]) for c in conds)
        context = torch.stack([torch.nn.functional.pad(c["context"], (0, 0, 0, longest - c["context"].shape[0]))
                               for c in conds])
        return {"context": context, "context_len": torch.stack([c["context_len"] for c in conds])}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """APG's unconditional: the condition encoder's learned `null_condition_emb` (1, 1, D)."""
        if guidance.scale == 1.0:
            return {}
        if self.is_turbo:
            raise UserError(f"rollout.guidance_scale={guidance.scale:g}: {self.root} is a turbo (guidance-distilled) "
                            "ACE-Step checkpoint; use rollout.guidance_scale=1.0")
        return {"null": self.condition_encoder.null_condition_emb.detach().float()}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        if shape.seconds and abs(shape.seconds - self.seconds) > 1e-6:
            raise ValueError(f"ACE-Step conditions on its duration: set model.options.seconds={shape.seconds:g} "
                             f"(the adapter was built for {self.seconds:g} s)")
        return {"x": (self.frames, self.transformer.config.audio_acoustic_hidden_dim)}

    def sigmas(self, num_steps: int, shape: MediaShape | None = None) -> torch.Tensor:
        """AceStepPipeline's grid: the shift s·u/(1 + (s − 1)·u) of u = linspace(1, 0, N + 1), in float32 as the
        pipeline computes it (SD3's timestep shift, Esser et al. 2024 §5.3.2)."""
        u = torch.linspace(1.0, 0.0, num_steps + 1)
        return (self.shift * u / (1 + (self.shift - 1) * u)) if self.shift != 1.0 else u

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        return ace_forward_flops(self.transformer.config, latents["x"].shape[1], int(cond["context_len"].max()))

    def _forward(self, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """One network call per context length, each sample's context cut to its own prompt (no padding attended)."""
        lengths = cond["context_len"]
        out: Latents = {}
        for length in torch.unique(lengths).tolist():
            index = (lengths == length).nonzero().squeeze(1)
            part = super()._forward({k: v[index] for k, v in latents.items()}, sigma[index],
                                    {"context": cond["context"][index, :length], "context_len": lengths[index]})
            for k, v in part.items():
                if k not in out:
                    out[k] = v.new_empty((sigma.shape[0], *v.shape[1:]))
                out[k][index] = v
        return out

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        x = latents["x"].to(self.dtype)
        t = sigma.to(self.dtype)
        context = self._context_latents.to(x.device, self.dtype).expand(x.shape[0], -1, -1)
        out = network(hidden_states=x, timestep=t, timestep_r=t, encoder_hidden_states=cond["context"].to(self.dtype),
                      context_latents=context, return_dict=False)[0]
        return {"x": out}

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """The conditional velocity, or APG (`ace_apg`) against the null condition for the samples whose 1 − σ lies in
        [cfg_interval_start, cfg_interval_end] (one batched forward of cond ⊕ null)."""
        if not shared or guidance == 1.0:
            return self._forward(latents, sigma, cond)
        ratio = 1.0 - sigma.float()
        guided = (ratio >= self.opts["cfg_interval_start"]) & (ratio <= self.opts["cfg_interval_end"])
        out = {k: v.new_empty(v.shape, dtype=torch.float32) for k, v in latents.items()}
        plain = (~guided).nonzero().squeeze(1)
        if len(plain):
            part = self._forward({k: v[plain] for k, v in latents.items()}, sigma[plain],
                                 {k: v[plain] for k, v in cond.items()})
            for k in out:
                out[k][plain] = part[k]
        index = guided.nonzero().squeeze(1)
        if len(index):
            sub = {k: v[index] for k, v in cond.items()}
            null = {"context": shared["null"].to(sub["context"]).expand_as(sub["context"]), "context_len": sub["context_len"]}
            both = self._forward({k: torch.cat([v[index], v[index]]) for k, v in latents.items()},
                                 torch.cat([sigma[index], sigma[index]]),
                                 {k: torch.cat([sub[k], null[k]]) for k in sub})
            for k in out:
                v_cond, v_null = both[k].chunk(2)
                out[k][index] = ace_apg(v_cond, v_null, guidance)
        return out

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        audio = self.vae.decode(latents["x"].to(self.device, torch.float32).transpose(1, 2)).sample.float()
        return {"audio": Audio(ace_peak_normalize(audio), self.sample_rate)}

    @torch.no_grad()
    def encode_media(self, media: Media) -> Latents:
        """A waveform at the VAE's rate, zero-padded (or cut) to T latent frames -> the posterior mean (B, T, C). The
        decode's peak normalisation is not undone (it loses the clip's level)."""
        audio = media["audio"]
        if audio.sample_rate != self.sample_rate:
            raise ValueError(f"ACE-Step encodes audio at {self.sample_rate} Hz, got {audio.sample_rate} Hz")
        wave = audio.waveform.to(self.device, torch.float32)
        length = self.frames * self.hop
        padded = wave.new_zeros(wave.shape[0], self.vae.config.audio_channels, length)
        padded[:, :, : min(length, wave.shape[-1])] = wave[:, :, :length]
        return {"x": self.vae.encode(padded).latent_dist.mean.transpose(1, 2)}

