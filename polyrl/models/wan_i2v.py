"""Wan image-to-video (`model=wan_i2v`): a video whose first frame is a condition image from the data file (the
`image` column, polyrl/data/prompts.py), loaded from a local diffusers Wan directory. Two published layouts, told
apart by the checkpoint's `expand_timesteps` (model_index.json):

- **Wan2.2-TI2V-5B** (`expand_timesteps=True`): the transformer is the text-to-video one (in_channels = z_dim 48).
  The condition image is VAE-encoded *alone* (one frame → one latent frame) and *is* the first latent frame: before
  every transformer call the pipeline sets latents = (1 − m)·c + m·latents (m 0 on latent frame 0, 1 elsewhere),
  the per-token timestep is m·t (0 on frame 0's tokens), and after the last step frame 0 is replaced once more
  before decoding. Its scheduler steps frame 0 too, but those values are never read.
- **Wan2.2-I2V-A14B / Wan2.1-I2V** (no expand_timesteps): every latent frame is sampled. The condition is the video
  [image, F − 1 black frames] VAE-encoded (c: z_dim × F_lat), and a mask of 4 channels (the VAE's 4× temporal
  packing of a per-pixel-frame mask: 1 on latent frame 0, i.e. the image frame repeated 4 times, 0 elsewhere); the
  transformer input is [latents, mask, c] along channels (in_channels = 2·16 + 4 = 36), one timestep per sample.

Facts taken from diffusers' `WanImageToVideoPipeline` (0.42.1), which this adapter reproduces:
- The image is resized to the video's height × width and scaled to [−1, 1] (`VideoProcessor.preprocess`: PIL
  Lanczos), encoded with the posterior mode and normalised like the latents, (z − mean) · (1 / std).
- Guidance: true CFG, v_u + s·(v_c − v_u); the unconditional branch keeps the image condition (only the text is
  the negative prompt's). Two experts (A14B) switch at boundary_ratio as in text-to-video (models/wan.py).
- Wan2.1-I2V also feeds CLIP image embeddings (`image_encoder`, transformer `image_dim`): not supported here, such a
  checkpoint is refused with a UserError.

How polyrl holds the TI2V condition frame: it is *not part of the sampled latent state*. `latent_shapes` gives the
F_lat − 1 generated frames; the network call puts the condition frame in front (timestep 0 on its tokens) and drops
its output row, so the velocity, every SDE transition, its Gaussian log-density (a mean over the sampled elements
only) and every loss see the generated frames alone: the fixed frame contributes no term at all, rather than a term
forced to zero. `complete_latents` puts the condition frame back in front of the final latents before `decode` —
the pipeline's final replacement — and `encode_media` drops the first latent frame (the condition's place).

The condition depends on the video size, so the adapter is built for one: `model.options` height / width /
num_frames, which the model config sets to ${rollout.*} (`latent_shapes` refuses any other size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from .base import Cond, Guidance, Media, Prompt, register_model
from .condition_images import condition_paths, load_rgb
from .diffusers_base import load_model_index
from .wan import WanPolicy, wan_forward_flops

MASK_CHANNELS = 4  # the VAE's temporal factor: a per-pixel-frame mask packed 4 frames per latent frame


def _refuse_clip_image_embeddings(root: Path) -> None:
    """UserError for a checkpoint that conditions on CLIP image embeddings (Wan2.1-I2V: an `image_encoder`
    component, transformer `image_dim`), read from model_index.json and the transformers' config.json."""
    index = load_model_index(root)
    image_dims = []
    for name in ("transformer", "transformer_2"):
        config = root / name / "config.json"
        if config.is_file():
            image_dims.append(json.loads(config.read_text()).get("image_dim"))
    encoder = index.get("image_encoder")
    if any(d is not None for d in image_dims) or (isinstance(encoder, list) and encoder[0] is not None):
        raise UserError(f"model.path={str(root)!r} conditions on CLIP image embeddings (an image_encoder component "
                        f"/ transformer image_dim), as Wan2.1-I2V does; model=wan_i2v does not support that yet "
                        "(Wan2.2-TI2V-5B and Wan2.2-I2V-A14B need none)")


@register_model("wan_i2v")
class WanI2VPolicy(WanPolicy):
    family = "Wan image-to-video"
    condition_images = True  # every data row needs an `image` (the trainer refuses rows without)
    # the video size the condition image is prepared for; polyrl/config/model/wan_i2v.yaml sets ${rollout.*}
    options = {**WanPolicy.options, "height": None, "width": None, "num_frames": None}

    def __init__(self, cfg, device: torch.device):
        from diffusers.video_processor import VideoProcessor

        _refuse_clip_image_embeddings(Path(cfg.path))  # before billions of weights load
        super().__init__(cfg, device)
        given = dict(getattr(cfg, "options", None) or {})
        size = []
        for key in ("num_frames", "height", "width"):
            value = given.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"model.options.{key}={value!r}: model=wan_i2v prepares the condition image for one "
                                f"video size; set it to a positive integer (the model config: ${{rollout.{key}}})")
            size.append(value)
        self.video = tuple(size)  # (frames, height, width) in pixels
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial_factor)  # as WanImageToVideoPipeline
        self._negatives: dict[str, Cond] = {}

    def _check_channels(self, in_channels: int, z_dim: int) -> None:
        want = z_dim if self.expand_timesteps else 2 * z_dim + MASK_CHANNELS
        if in_channels != want:
            layout = ("Wan2.2-TI2V (expand_timesteps): the latents" if self.expand_timesteps
                      else "channel-concat I2V: latents + 4 mask + condition latents")
            raise ValueError(f"{self.root}: the transformer takes {in_channels} channels, but {layout} are {want}; "
                             "a text-to-video Wan checkpoint is model=wan")

    # ------------------------------------------------------------------------------------------- prompts
    @torch.no_grad()
    def encode_condition(self, path: str) -> torch.Tensor:
        """The condition latents of one image, normalised: (z, 1, h, w) for TI2V (the first latent frame), (z, F_lat,
        h, w) for channel-concat I2V (the image followed by F − 1 zero frames, encoded as one video)."""
        frames, height, width = self.video
        pixels = self.video_processor.preprocess(load_rgb(path), height=height, width=width)
        video = pixels.to(self.device, torch.float32).unsqueeze(2)  # (1, 3, 1, H, W) in [−1, 1]
        if not self.expand_timesteps:
            video = torch.cat([video, video.new_zeros(1, 3, frames - 1, height, width)], 2)
        z = self.vae.encode(video).latent_dist.mode()
        return ((z - self._latents_mean) * (1.0 / self._latents_std))[0]

    def _encode_one(self, prompt: Prompt) -> Cond:
        text, (path,) = condition_paths(prompt, self.family, max_images=1)
        return {**super()._encode_one(text), "condition": self.encode_condition(path)}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """The negative prompt's text embeddings only: the unconditional branch keeps each sample's image (`_pair`)."""
        if guidance.scale == 1.0:
            return {}
        text = guidance.negative_prompt
        if text not in self._negatives:
            with torch.no_grad():
                self._negatives[text] = super()._encode_one(text)
        return {k: v[None] for k, v in self._negatives[text].items()}

    def _pair(self, cond: Cond, shared: Cond) -> Cond:
        """(uncond ⊕ cond): the negative text for the first half; the image condition is the sample's in both."""
        b = cond["prompt_embeds"].shape[0]
        first = {k: shared[k].expand(b, *shared[k].shape[1:]) if k in shared else v for k, v in cond.items()}
        return {k: torch.cat([first[k], v]) for k, v in cond.items()}

    # ------------------------------------------------------------------------------------------- diffusion
    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        wanted = (shape.frames, shape.height, shape.width)
        if wanted != self.video:
            raise ValueError(f"rollout (num_frames, height, width) = {wanted}, but model.options prepare the condition "
                             f"image for {self.video}; leave model.options.num_frames/height/width at ${{rollout.*}}")
        c, f, h, w = super().latent_shapes(shape)["x"]
        if not self.expand_timesteps:
            return {"x": (c, f, h, w)}
        if f < 2:
            raise ValueError(f"rollout.num_frames={shape.frames}: Wan2.2-TI2V image-to-video keeps the first latent "
                             f"frame for the condition image, so it needs num_frames >= {self.temporal_factor + 1}")
        return {"x": (c, f - 1, h, w)}  # the generated frames; the condition frame is not sampled

    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        c = self.transformer.config
        _, f, h, w = latents["x"].shape[1:]
        f += 1 if self.expand_timesteps else 0  # the condition frame's tokens run through the network too
        tokens = (f // c.patch_size[0]) * (h // c.patch_size[1]) * (w // c.patch_size[2])
        return wan_forward_flops(c, tokens, cond["prompt_embeds"].shape[1], per_token_timesteps=self.expand_timesteps)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        x = latents["x"].to(self.dtype)
        condition = cond["condition"].to(self.dtype)
        timestep = self._timestep(sigma)
        if self.expand_timesteps:
            hidden = torch.cat([condition, x], 2)  # = (1 − m)·c + m·latents with frame 0 the condition
            _, ph, pw = network.config.patch_size
            mask = torch.ones(hidden.shape[2:], device=x.device)
            mask[0] = 0
            timestep = timestep[:, None] * mask[:, ::ph, ::pw].flatten()[None]  # 0 on the condition frame's tokens
        else:
            b, _, f, h, w = x.shape
            mask = x.new_zeros(b, MASK_CHANNELS, f, h, w)
            mask[:, :, 0] = 1
            hidden = torch.cat([x, mask, condition], 1)
        text = cond["prompt_embeds"].to(self.dtype)
        out = network(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        return {"x": out[:, :, 1:] if self.expand_timesteps else out}

    # ------------------------------------------------------------------------------------------- media
    def complete_latents(self, latents: Latents, cond: Cond) -> Latents:
        """TI2V: the condition frame in front of the generated ones (the pipeline's last replacement); else as is."""
        if not self.expand_timesteps:
            return latents
        x = latents["x"]
        return {"x": torch.cat([cond["condition"].to(x.device, x.dtype), x], 2)}

    def decode(self, latents: Latents) -> Media:
        frames = (self.video[0] - 1) // self.temporal_factor + 1
        if latents["x"].shape[2] != frames:
            raise ValueError(f"{self.family} decodes {frames} latent frames, got {latents['x'].shape[2]}: pass the "
                             "sampled latents through complete_latents(latents, cond) first")
        return super().decode(latents)

    def encode_media(self, media: Media) -> Latents:
        """Video -> latents in the sampled layout (TI2V: without the first latent frame, the condition's place)."""
        x = super().encode_media(media)["x"]
        return {"x": x[:, :, 1:] if self.expand_timesteps else x}
