"""MiniMax-H3 joint video + audio adapter (`model=minimax_h3`), loaded from a local diffusers modular-pipeline
directory (`modular_model_index.json`: `MiniMaxH3ModularPipeline`) with its own blocks, in one of three modes
(`model.options.mode`):

- `t2va`: text → video with sound;
- `fl2va`: first (and optionally last) keyframe + text: each data row's `image` column holds 1 or 2 paths;
- `ref2va`: reference images + text (`image` column: 1 or more paths; the prompt names them `<Picture i>`),
  run by the checkpoint's `transformer_ref` partition.

Facts taken from diffusers' modular pipeline (0.42.1), which this adapter reuses rather than re-implements:
- **One packed sequence.** The transformer attends over `[text | condition video rows | audio rows | target video]`
  (full self-attention, no cross-attention); every row has a modality tag, a (t, h, w) rotary coordinate and a
  timestep index. The layout depends on the prompt (its token count, its keyframe / reference vision blocks), so it
  is built per prompt by the pipeline's own pre-denoise blocks (text encoder, VAE encoder of the conditions, layout)
  and stored in the conditioning; one forward takes a batch only of samples that share a layout and a σ
  (`velocity` groups them).
- **Guidance-distilled**: no unconditional pass, so `rollout.guidance_scale` must be 1.
- **Conventions**: the transformer predicts a data-ward velocity (x0 = x + σ·v) at t = 1 − σ in [0, 1]; polyrl's
  velocity is its negative (x0 = x − σ·v), so the step math of `sampling/steps.py` applies unchanged.
- **Two σ schedules** (`MiniMaxH3Scheduler`, one instance per stream): video shift 12 and audio shift 3 on the same
  linspace(1, 0, N + 1) base grid. The batch stores the video σ; `stream_sigmas` maps it to the audio σ of the same
  grid point (`reshift`), and steps, KL terms and forward-process noising use each stream's own σ.
- **Condition rows** (keyframes at t = max(t_video, `keyframe_noise_aug`), reference audio rows clean at t = 1) are
  *not* part of the sampled state: they come from the conditioning and are put in front of the sampled rows for
  every forward (as the pipeline writes only the generated rows). Their values are the pipeline's: VAE posterior
  samples under the pipeline's fixed seed, noised at the noise-augmentation level by the pre-denoise blocks with a
  per-prompt generator seeded 0 (deterministic per prompt).
- Latents: `{"video": (B, 24, F, h, w)}` (unpatchified, normalised) and `{"audio": (B, 2·L, 32)}` (the stereo
  channels' rows, channel-major, as the transformer reads them); F, h, w, L come from the video size, which the
  layout fixes: `model.options` num_frames / height / width (the model config sets them to `${rollout.*}`).
  The pipeline generates 5–15 s at 24 fps with `17n + 5` frames (124 … 345).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from ..media import Audio
from .base import Cond, Guidance, Media, Prompt, prompt_text, register_model
from .condition_images import condition_paths, load_rgb
from .diffusers_base import DTYPES, DiffusersPolicy
from .options import read_options

MODES = ("t2va", "fl2va", "ref2va")
# q/k/v/out of the self-attention and the SwiGLU feed-forward of every block (and of the text token refiner)
MINIMAX_H3_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"]
LAYOUT_KEYS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")


def reshift(sigma: torch.Tensor, from_shift: float, to_shift: float) -> torch.Tensor:
    """The σ of the same base-grid point under another exponential shift (docs/video_audio.md, MiniMax-H3):
    σ = s·u / (1 + (s − 1)·u) inverts to u = σ / (s − (s − 1)·σ), then σ' = s'·u / (1 + (s' − 1)·u). Computed in
    float64, returned in σ's dtype."""
    s = sigma.double()
    u = s / (from_shift - (from_shift - 1) * s)
    return (to_shift * u / (1 + (to_shift - 1) * u)).to(sigma.dtype)


def pad_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack tensors of different lengths along dim 0, zero-padded to the longest (the true lengths travel in
    the conditioning's `layout`)."""
    n = max(t.shape[0] for t in tensors)
    return torch.stack([torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]) for t in tensors])


@register_model("minimax_h3")
class MiniMaxH3Policy(DiffusersPolicy):
    default_lora_targets = MINIMAX_H3_LORA_TARGETS
    family = "MiniMax-H3"
    options = {
        "mode": "t2va",          # t2va | fl2va | ref2va
        "num_frames": 124.0,     # the video the layout is built for (the model config: ${rollout.num_frames})
        "height": 384.0,
        "width": 672.0,
        "video_shift": None,     # null: the checkpoint's `scheduler` shift (12)
        "audio_shift": None,     # null: the checkpoint's `audio_scheduler` shift (3)
    }

    @staticmethod
    def condition_images(options) -> bool:
        """FL2VA and Ref2VA read their keyframes / references from the data file's `image` column."""
        return str((options or {}).get("mode", "t2va")) != "t2va"

    def __init__(self, cfg, device: torch.device):  # not super().__init__: it reads model_index.json, absent here
        from diffusers import ModularPipeline
        from diffusers.modular_pipelines import SequentialPipelineBlocks

        self.root = Path(cfg.path)
        if not (self.root / "modular_model_index.json").is_file():
            raise UserError(f"model.path={str(self.root)!r} is not a diffusers modular-pipeline directory (no "
                            "modular_model_index.json); MiniMax-H3 loads through MiniMaxH3ModularPipeline")
        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.networks: dict[str, torch.nn.Module] = {}
        self._cache: dict[str, Cond] = {}
        self.flops = 0.0
        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.mode = self.opts["mode"]
        if self.mode not in MODES:
            raise UserError(f"model.options.mode={self.mode!r}; allowed: {', '.join(MODES)}")
        self.video = (int(self.opts["num_frames"]), int(self.opts["height"]), int(self.opts["width"]))
        try:
            pipe = ModularPipeline.from_pretrained(str(self.root), workflow=self.mode)
        except (ImportError, OSError, ValueError) as e:
            raise UserError(f"model.path={str(self.root)!r}: cannot load the MiniMax-H3 pipeline: {e}") from None
        network = "transformer_ref" if self.mode == "ref2va" else "transformer"
        # the transformer (which keeps its own float32 modules) and the text encoder in model.dtype; the VAEs in
        # float32, as polyrl decodes everywhere
        pipe.load_components(dtype={network: self.dtype, "text_encoder": self.dtype, "default": torch.float32})
        for name in pipe.pretrained_component_names:
            component = getattr(pipe, name, None)
            if isinstance(component, torch.nn.Module):
                component.to(device).eval().requires_grad_(False)
        self.pipe = pipe
        self.networks["transformer"] = getattr(pipe, network)
        flat = pipe.blocks
        names = list(flat.sub_blocks)
        cut = names.index("denoise.denoise")  # everything before the loop: encoders, layout, conditions, timesteps
        pre = SequentialPipelineBlocks.from_blocks_dict({n: flat.sub_blocks[n] for n in names[:cut]})
        self.pre = type(pipe)(blocks=pre, pretrained_model_name_or_path=str(self.root))
        self.pre.update_components(**{n: getattr(pipe, n) for n in self.pre._component_specs
                                      if getattr(pipe, n, None) is not None})
        vs, as_ = pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift
        self.video_shift = float(vs if self.opts["video_shift"] is None else self.opts["video_shift"])
        self.audio_shift = float(as_ if self.opts["audio_shift"] is None else self.opts["audio_shift"])
        self.noise_aug = float(pipe.keyframe_noise_aug)
        self.patch = tuple(pipe.patch_size)
        self.channels = int(pipe.vae_latent_channels)
        self.audio_channels = int(pipe.audio_channels)
        self.sample_rate = int(pipe.audio_sampling_rate)

    # ------------------------------------------------------------------------------------------- prompts
    def _request(self, prompt: Prompt) -> dict:
        """The pipeline call arguments of one prompt in this mode."""
        frames, height, width = self.video
        call = dict(num_frames=frames, height=height, width=width, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0))
        if self.mode == "t2va":
            if not isinstance(prompt, str) and prompt.get("images"):
                raise UserError(f"model.options.mode=t2va takes text only; the prompt {prompt_text(prompt)!r} carries "
                                "images (fl2va: first/last keyframes, ref2va: references)")
            return {"prompt": prompt_text(prompt), **call}
        text, paths = condition_paths(prompt, f"{self.family} {self.mode}", 2 if self.mode == "fl2va" else None)
        images = [load_rgb(p) for p in paths]
        if self.mode == "fl2va":
            return {"prompt": text, "image": images[0], **({"last_image": images[1]} if len(images) > 1 else {}), **call}
        from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

        return {"prompt": text, "references": [MiniMaxH3ImageReference(image=i) for i in images], **call}

    @torch.no_grad()
    def prepare(self, prompt: Prompt):
        """The pipeline's pre-denoise state for one prompt (text encoder, condition encoders, layout)."""
        return self.pre(**self._request(prompt))

    def _encode_one(self, prompt: Prompt) -> Cond:
        state = self.prepare(prompt)
        want = self.latent_shapes(MediaShape(height=self.video[1], width=self.video[2], frames=self.video[0], fps=24.0))
        got = (self.channels, state.get("num_latent_frames"), state.get("latent_height"), state.get("latent_width"))
        if got != want["video"]:
            raise ValueError(f"the pipeline laid out {got} video latents for {self.video}, expected {want['video']}")
        nv, na = state.get("num_condition_video_rows"), state.get("num_condition_audio_rows")
        layout = {k: state.get(k).cpu() for k in LAYOUT_KEYS}
        embeds = state.get("prompt_embeds")[0].float().cpu()
        return {"prompt_embeds": embeds, "cond_video": state.get("latents")[:nv].float().cpu(),
                "cond_audio": state.get("audio_latents")[:na].float().cpu(), **layout,
                "layout": torch.tensor([embeds.shape[0], nv, na, layout["token_tags"].shape[0]])}

    def _collate(self, conds: list[Cond]) -> Cond:
        """Every per-prompt tensor zero-padded to the batch's longest (the lengths are in `layout`)."""
        return {k: pad_rows([c[k] for c in conds]) for k in conds[0]}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        if guidance.scale != 1.0:
            raise UserError(f"rollout.guidance_scale={guidance.scale}: MiniMax-H3 is guidance-distilled (no "
                            "unconditional pass); set rollout.guidance_scale=1")
        return {}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            align_num_frames,
            audio_latent_num_frames,
            video_latent_num_frames,
        )

        pipe = self.pipe
        if (shape.frames, shape.height, shape.width) != self.video:
            raise ValueError(f"rollout {shape.frames}×{shape.height}×{shape.width} differs from model.options "
                             f"{self.video[0]}×{self.video[1]}×{self.video[2]}, the size the layout is built for")
        if shape.fps != pipe.fps:
            raise ValueError(f"rollout.fps={shape.fps}: MiniMax-H3 generates at {pipe.fps} fps")
        fpc, lpc = pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk
        if align_num_frames(shape.frames, fpc, lpc) != shape.frames or not (
                pipe.min_duration <= shape.frames / pipe.fps <= pipe.max_duration):
            lo, hi = int(pipe.min_duration * pipe.fps), int(pipe.max_duration * pipe.fps)
            raise ValueError(f"rollout.num_frames={shape.frames}: MiniMax-H3 needs {fpc}n + {fpc - 12} frames between "
                             f"{lo} and {hi} ({pipe.min_duration:g}–{pipe.max_duration:g} s at {pipe.fps} fps), e.g. "
                             f"{align_num_frames(max(shape.frames, lo), fpc, lpc)}")
        m = pipe.canvas_multiple
        if shape.height % m or shape.width % m:
            raise ValueError(f"rollout.height/width={shape.height}×{shape.width} must be multiples of {m}")
        r = pipe.vae_spatial_compression_ratio
        frames = video_latent_num_frames(shape.frames, fpc, lpc)
        return {"video": (self.channels, frames, shape.height // r, shape.width // r),
                "audio": (self.audio_channels * audio_latent_num_frames(shape.frames), self.pipe.audio_vae.config.latent_channels)}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        """The video stream's grid: linspace(1, 0, N + 1) through shift s_v (MiniMaxH3Scheduler, N + 1 points)."""
        from diffusers import MiniMaxH3Scheduler

        scheduler = MiniMaxH3Scheduler(shift=self.video_shift)
        scheduler.set_timesteps(num_steps + 1)
        sigmas = scheduler.sigmas.float().cpu()
        if len(sigmas) != num_steps + 1:
            raise ValueError(f"rollout.num_steps={num_steps}: shift {self.video_shift} collapses grid points in float32")
        return sigmas

    def stream_sigmas(self, sigma: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"video": sigma, "audio": reshift(sigma, self.video_shift, self.audio_shift)}

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """Model FLOPs of one forward of one sample (§6): 2 × block parameters × rows, attention 4·S²·(heads·head
        dim) per block; the token refiner over the text rows and the projections in/out are counted the same way."""
        c = self.transformer.config
        text, nv, na, seq = (int(v) for v in cond["layout"][0])
        blocks = sum(p.numel() for p in self.transformer.transformer_blocks.parameters())
        refiner = sum(p.numel() for p in self.transformer.token_refiner.parameters())
        inner = c.num_attention_heads * c.attention_head_dim
        attention = 4 * seq * seq * inner * c.num_layers + 4 * text * text * inner * c.num_refiner_layers
        heads = sum(p.numel() for n in ("proj_out", "audio_proj_out") for p in getattr(self.transformer, n).parameters())
        return float(2 * blocks * seq + 2 * refiner * text + 2 * heads * seq + attention)

    def _groups(self, sigma: torch.Tensor, cond: Cond) -> list[torch.Tensor]:
        """Sample indices that share a σ and a packed layout (one transformer call each)."""
        groups: list[list[int]] = []
        for i in range(sigma.shape[0]):
            for g in groups:
                j = g[0]
                if sigma[i] == sigma[j] and torch.equal(cond["layout"][i], cond["layout"][j]) and all(
                        torch.equal(cond[k][i], cond[k][j]) for k in LAYOUT_KEYS):
                    g.append(i)
                    break
            else:
                groups.append([i])
        return [torch.tensor(g, device=sigma.device) for g in groups]

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """One call over samples of one layout and one σ: condition rows + sampled rows in, sampled rows out."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3SetTimestepsStep,
            patchify_video_latents,
        )

        text, nv, na, seq = (int(v) for v in cond["layout"][0])
        video = latents["video"]
        b, ch, frames, height, width = video.shape
        pt, ph, pw = self.patch
        rows = patchify_video_latents(video, self.patch).view(b, -1, ch * pt * ph * pw)
        layout = {k: cond[k][0] for k in LAYOUT_KEYS}
        n_video = nv + rows.shape[1]
        n_audio = na + latents["audio"].shape[1]
        layout["video_indices"] = layout["video_indices"][:n_video]
        layout["audio_indices"] = layout["audio_indices"][:n_audio]
        layout["text_indices"] = layout["text_indices"][:text]
        layout["position_ids"], layout["token_tags"] = layout["position_ids"][:seq], layout["token_tags"][:seq]
        sigmas = self.stream_sigmas(sigma[:1].float())
        t_video, t_audio = float(1 - sigmas["video"][0]), float(1 - sigmas["audio"][0])
        unique, index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout["video_indices"], layout["audio_indices"], nv, na, text, t_video, t_audio,
            max(t_video, self.noise_aug), 1.0)
        v, a = network(
            hidden_states=torch.cat([cond["cond_video"][:, :nv], rows], 1),
            audio_hidden_states=torch.cat([cond["cond_audio"][:, :na], latents["audio"]], 1),
            encoder_hidden_states=cond["prompt_embeds"][:, :text].to(self.dtype),
            timestep=unique.to(video.device), timestep_indices=index.to(video.device), return_dict=False, **layout)
        v = v[:, nv:].reshape(b, frames // pt, height // ph, width // pw, ch, pt, ph, pw)
        v = v.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, ch, frames, height, width)
        return {"video": -v, "audio": -a[:, na:]}  # data-ward → polyrl's noise-ward velocity

    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """One transformer call per group of samples sharing a layout and a σ; `guidance` is 1 (`encode_guidance`,
        which every rollout calls first, refuses another scale)."""
        groups = self._groups(sigma, cond)
        if len(groups) == 1:
            return self._forward(latents, sigma, cond)
        parts = [self._forward({k: v[g] for k, v in latents.items()}, sigma[g], {k: v[g] for k, v in cond.items()})
                 for g in groups]
        order = torch.argsort(torch.cat(groups))
        return {k: torch.cat([p[k] for p in parts])[order] for k in latents}

    # ------------------------------------------------------------------------------------------- media
    @torch.no_grad()
    def decode(self, latents: Latents) -> Media:
        """Video: denormalise, the VAE, then its ImageNet pixel convention back to [0, 1]; audio: each sample's
        stereo rows as two items of the mono audio VAE (the pipeline's decode blocks)."""
        pipe, dev = self.pipe, self.device
        mean = torch.tensor(pipe.vae.config.latents_mean, device=dev).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std, device=dev).view(1, -1, 1, 1, 1)
        pixel_mean = torch.tensor(pipe.pixel_mean, device=dev).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(pipe.pixel_std, device=dev).view(1, -1, 1, 1, 1)
        audio_mean = torch.tensor(pipe.audio_vae.config.latents_mean, device=dev).view(1, -1, 1)
        audio_std = torch.tensor(pipe.audio_vae.config.latents_std, device=dev).view(1, -1, 1)
        videos, waves = [], []
        for video, audio in zip(latents["video"], latents["audio"], strict=True):
            frames = pipe.vae.decode(video[None].to(dev, torch.float32) * std + mean, return_dict=False)[0]
            videos.append((frames.float() * pixel_std + pixel_mean).clamp(0, 1)[0].permute(1, 0, 2, 3))
            rows = audio.to(dev, torch.float32).view(self.audio_channels, -1, audio.shape[-1]).permute(0, 2, 1)
            waves.append(pipe.audio_vae.decode(rows * audio_std + audio_mean, return_dict=False)[0].float()[:, 0])
        return {"video": torch.stack(videos), "audio": Audio(torch.stack(waves).clamp(-1, 1), self.sample_rate)}

    def encode_media(self, media: Media) -> Latents:
        raise NotImplementedError("MiniMax-H3 cannot encode decoded media back to latents (offline pairs are not "
                                  "supported for MiniMax-H3)")
