"""Qwen-Image-Edit and Qwen-Image-Edit-Plus adapters: Qwen-Image's transformer conditioned on source images.

Facts taken from diffusers' `QwenImageEditPipeline` and `QwenImageEditPlusPipeline` (0.42.1), which these adapters
reproduce; everything else (packing, sigmas, true CFG, VAE) is Qwen-Image's (`qwen_image.py`):
- Each condition image enters twice. (1) Through the Qwen2.5-VL encoder: the chat template holds
  `<|vision_start|><|image_pad|><|vision_end|>` before the instruction (Plus writes "Picture i: " before each
  image's block), the processor expands each `<|image_pad|>` to one token per 2×2-merged vision patch, and the last
  hidden state minus the template's first 64 tokens (system prompt + user header) is the text stream, vision tokens
  included; nothing is truncated. (2) As latents: the condition is VAE-encoded (posterior mode, normalised like the
  generated latents), packed in 2×2 patches and concatenated after the noise tokens along the sequence.
  `img_shapes` lists the noise grid and then each condition's grid, so RoPE gives condition i the frame index i;
  the transformer's output on the condition tokens is dropped.
- Condition size: Edit resizes the condition (for both paths) to about a 1024² area, aspect kept, each side
  rounded to a multiple of 32 (`condition_dims`); Plus resizes the VL input to a 384² area and the VAE input to
  1024². Here the two sides of those areas are `model.condition_size` (the VAE / latent condition) and
  `model.vl_condition_size` (the VL encoder's image; null: the variant's published value).
- The sigma grid's shift μ counts the noise tokens only.
- True CFG: the negative prompt is encoded *with the sample's condition images*, so the unconditional branch is
  per sample. It is therefore encoded with each prompt (`model.negative_prompt`, which the model config
  interpolates from `rollout.negative_prompt`) and travels in `cond` (`negative_embeds`); the shared conditioning
  only says that CFG is on.
- Samples whose condition images give different latent grids (other aspect ratios, other image counts) cannot
  share one transformer call (the condition tokens carry no mask): the network runs once per distinct grid.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..latents import Latents
from .base import Cond, Guidance, Prompt, register_model
from .condition_images import condition_paths, load_rgb
from .diffusers_base import pipeline_components
from .qwen_image import QwenImagePolicy, pack_latents, pad_text, qwen_image_forward_flops, repad, unpack_latents

# The templates the Edit models were trained with (the model's, not polyrl's choice) and the number of their leading
# tokens that are dropped: the system prompt and the user header, 64 tokens with the Qwen2 tokenizer.
EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
EDIT_TEMPLATE = EDIT_SYSTEM + VISION_SLOT + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_PICTURE = "Picture {}: " + VISION_SLOT
EDIT_TEMPLATE_DROP = 64
SIZE_MULTIPLE = 32  # condition sides are rounded to multiples of 32 px


# ----------------------------------------------------------------------------------------------- pure pieces
def condition_dims(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) of a condition resized to about side² pixels with its aspect ratio r = width/height kept:
    w = round(√(side²·r) / 32)·32, h = round(√(side²·r) / r / 32)·32 (the pipelines' `calculate_dimensions`)."""
    ratio = width / height
    w = math.sqrt(side * side * ratio)
    return round(w / SIZE_MULTIPLE) * SIZE_MULTIPLE, round(w / ratio / SIZE_MULTIPLE) * SIZE_MULTIPLE


def edit_prompt(text: str, num_images: int, plus: bool) -> str:
    """The chat text the VL encoder reads: Edit has one vision slot before the instruction; Plus one
    "Picture i: " slot per condition image."""
    if not plus:
        return EDIT_TEMPLATE.format(text)
    return PLUS_TEMPLATE.format("".join(PLUS_PICTURE.format(i + 1) for i in range(num_images)) + text)


def expand_image_pads(text: str, counts: list[int]) -> str:
    """Replace the i-th `<|image_pad|>` by counts[i] copies (one per merged vision patch of image i), as the
    Qwen2-VL processor does."""
    parts = text.split(IMAGE_PAD)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} image slots in the prompt for {len(counts)} images")
    return parts[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, parts[1:], strict=True))


def grid_groups(grids: torch.Tensor) -> dict[tuple[tuple[int, int], ...], torch.Tensor]:
    """Samples grouped by their condition grids: `grids` (B, K, 2) holds each condition's packed-token grid (rows,
    cols), zero rows for absent images; the key is the tuple of a sample's present grids, the value the sample
    indices (ascending)."""
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for i, sample in enumerate(grids.tolist()):
        key = tuple((int(r), int(c)) for r, c in sample if r > 0)
        groups.setdefault(key, []).append(i)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in groups.items()}


# ----------------------------------------------------------------------------------------------- adapters
@register_model("qwen_image_edit")
class QwenImageEditPolicy(QwenImagePolicy):
    family = "Qwen-Image-Edit"
    condition_images = True
    plus = False
    max_images: int | None = 1
    published_condition_size = 1024
    published_vl_condition_size: int | None = None  # None: the VL encoder sees the VAE condition's size

    def __init__(self, cfg, device: torch.device):
        from diffusers.image_processor import VaeImageProcessor
        from transformers import AutoImageProcessor, AutoTokenizer

        self.condition_size = int(cfg.get("condition_size") or self.published_condition_size)
        vl = cfg.get("vl_condition_size") or self.published_vl_condition_size
        self.vl_condition_size = int(vl) if vl else self.condition_size
        for key, side in (("condition_size", self.condition_size), ("vl_condition_size", self.vl_condition_size)):
            if side < SIZE_MULTIPLE:
                raise ValueError(f"model.{key}={side} must be >= {SIZE_MULTIPLE} (condition sides are multiples of "
                                 f"{SIZE_MULTIPLE} px)")
        self.negative_prompt = cfg.get("negative_prompt")
        # checked before any weight loads: the processor (VL image preprocessing + the tokenizer it pairs with)
        pipeline_components(Path(cfg.path), ("transformer", "vae", "scheduler", "text_encoder", "processor"),
                            self.family)
        super().__init__(cfg, device)
        # The pipelines tokenize with their processor's tokenizer; the processor itself (Qwen2VLProcessor) cannot be
        # built without torchvision (its video half), so its two halves are loaded and the image pads expanded here.
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.root / "processor"))
        self.vl_image_processor = AutoImageProcessor.from_pretrained(str(self.root / "processor"))
        self.vae_image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_text(self, text: str, vl_images: list) -> torch.Tensor:
        """(L, D) float32: the VL encoder's last hidden state of the templated prompt with its images, minus the
        template's first 64 tokens."""
        pixels = self.vl_image_processor(images=vl_images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        counts = (grid.prod(-1) // self.vl_image_processor.merge_size**2).tolist()
        chat = expand_image_pads(edit_prompt(text, len(vl_images), self.plus), counts)
        tok = self.tokenizer([chat], return_tensors="pt").to(self.device)
        out = self.text_encoder(input_ids=tok.input_ids, attention_mask=tok.attention_mask,
                                pixel_values=pixels["pixel_values"].to(self.device),
                                image_grid_thw=grid.to(self.device), output_hidden_states=True)
        return out.hidden_states[-1][0].float()[EDIT_TEMPLATE_DROP:]

    def _dims(self, image, path: str, key: str) -> tuple[int, int]:
        """`condition_dims` at model.`key`; a side that rounds to 0 (a very elongated image) is an error."""
        side = getattr(self, key)
        w, h = condition_dims(*image.size, side)
        if not (w and h):
            raise ValueError(f"condition image {path} ({image.size[0]}x{image.size[1]}) resized to about {side}² px "
                             f"gives a {w}x{h} condition: raise model.{key}")
        return w, h

    def _encode_condition(self, images: list, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition latents, packed and concatenated over the images (N, 4C), and each image's packed grid
        (K, 2)."""
        tokens, grids = [], []
        cfg = self.vae.config
        for image, path in zip(images, paths, strict=True):
            w, h = self._dims(image, path, "condition_size")
            pixels = self.vae_image_processor.preprocess(image, h, w).to(self.device, torch.float32)
            z = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
            mean = torch.tensor(cfg.latents_mean, device=z.device).view(1, -1, 1, 1)
            std = torch.tensor(cfg.latents_std, device=z.device).view(1, -1, 1, 1)
            z = (z - mean) / std
            tokens.append(pack_latents(z)[0])
            grids.append((z.shape[-2] // 2, z.shape[-1] // 2))
        return torch.cat(tokens), torch.tensor(grids, dtype=torch.long)

    def _encode_one(self, prompt: Prompt) -> Cond:
        text, paths = condition_paths(prompt, self.family, self.max_images)
        images = [load_rgb(p) for p in paths]
        vl_images = []
        for image, path in zip(images, paths, strict=True):
            w, h = self._dims(image, path, "vl_condition_size")
            vl_images.append(self.vae_image_processor.resize(image, h, w))  # PIL, as the pipelines hand it to the VL
        latents, grids = self._encode_condition(images, paths)
        cond = {"prompt_embeds": self._encode_text(text, vl_images), "condition_latents": latents,
                "condition_grids": grids}
        if self.negative_prompt is not None:
            cond["negative_embeds"] = self._encode_text(self.negative_prompt, vl_images)
        return cond

    def _collate(self, conds: list[Cond]) -> Cond:
        """Text right-padded with masks (`prompt_*`, `negative_*`); condition tokens right-padded with zeros and
        grids with zero rows (a sample's grids say how many of its tokens are real)."""
        embeds, mask = pad_text([c["prompt_embeds"] for c in conds])
        out = {"prompt_embeds": embeds, "prompt_mask": mask}
        if "negative_embeds" in conds[0]:
            out["negative_embeds"], out["negative_mask"] = pad_text([c["negative_embeds"] for c in conds])
        for key in ("condition_latents", "condition_grids"):
            rows = max(len(c[key]) for c in conds)
            out[key] = torch.stack([F.pad(c[key], (0, 0, 0, rows - len(c[key]))) for c in conds])
        return out

    def encode_guidance(self, guidance: Guidance) -> Cond:
        """True CFG needs each sample's negative conditioning, which `encode_prompts` made with the sample's images;
        the shared part is only the flag that CFG is on."""
        if guidance.scale == 1.0:
            return {}
        if self.negative_prompt is None:
            raise ValueError(f"{self.family} with guidance {guidance.scale} needs model.negative_prompt (encoded with "
                             "each sample's condition images; the model config sets it to rollout.negative_prompt)")
        if guidance.negative_prompt != self.negative_prompt:
            raise ValueError(f"rollout.negative_prompt={guidance.negative_prompt!r} differs from model.negative_prompt="
                             f"{self.negative_prompt!r}, which {self.family} encodes with each sample's condition "
                             "images")
        return {"true_cfg": torch.ones(1)}

    # ------------------------------------------------------------------------------------------- network
    def forward_flops(self, latents: Latents, cond: Cond) -> float:
        """Qwen-Image's count with the condition tokens as image tokens, averaged over the batch's samples."""
        h, w = latents["x"].shape[-2:]
        grids = cond["condition_grids"]
        conditions = (grids[..., 0] * grids[..., 1]).sum(-1).tolist()
        text = cond["prompt_embeds"].shape[1]
        noise = (h // 2) * (w // 2)
        per_sample = [qwen_image_forward_flops(self.transformer.config, noise + m, text) for m in conditions]
        return sum(per_sample) / len(per_sample)

    def _network_forward(self, network, latents: Latents, sigma: torch.Tensor, cond: Cond) -> Latents:
        """v on unpacked latents: noise tokens ⊕ condition tokens through the transformer, once per distinct set
        of condition grids; the output's first (noise) tokens, unpacked."""
        x = latents["x"]
        h, w = x.shape[-2:]
        noise = pack_latents(x.float())
        outs, order = [], []
        for grids, idx in grid_groups(cond["condition_grids"]).items():
            idx = idx.to(x.device)
            n_cond = sum(r * c for r, c in grids)
            mask = cond["prompt_mask"][idx]
            tokens = torch.cat([noise[idx], cond["condition_latents"][idx, :n_cond].float()], 1)
            y = network(
                hidden_states=tokens.to(self.dtype),
                timestep=sigma[idx].float(),  # σ, not 1000·σ: the embedding scales by 1000 itself
                encoder_hidden_states=cond["prompt_embeds"][idx].to(self.dtype),
                encoder_hidden_states_mask=None if mask.all() else mask,
                img_shapes=[[(1, h // 2, w // 2), *((1, r, c) for r, c in grids)]] * len(idx),
                return_dict=False,
            )[0]
            outs.append(y[:, : noise.shape[1]].float())
            order.append(idx)
        out = torch.cat(outs)[torch.argsort(torch.cat(order))]
        return {"x": unpack_latents(out, h, w)}

    def _pair(self, cond: Cond, shared: Cond) -> Cond:
        """uncond ⊕ cond: each sample's negative and positive text (padded to a common length), its condition
        tokens twice."""
        length = max(cond["prompt_embeds"].shape[1], cond["negative_embeds"].shape[1])
        neg = repad({"prompt_embeds": cond["negative_embeds"], "prompt_mask": cond["negative_mask"]}, length)
        pos = repad({"prompt_embeds": cond["prompt_embeds"], "prompt_mask": cond["prompt_mask"]}, length)
        both = {k: torch.cat([neg[k], pos[k]]) for k in pos}
        for k in ("condition_latents", "condition_grids"):
            both[k] = torch.cat([cond[k], cond[k]])
        return both


@register_model("qwen_image_edit_plus")
class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    family = "Qwen-Image-Edit-Plus"
    plus = True
    max_images = None
    published_vl_condition_size = 384
