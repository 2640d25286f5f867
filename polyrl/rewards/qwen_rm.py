"""A Qwen-VL regression reward model, the pieces `hpsv3`, `edit_reward` and `videoalign` share: the base directory
(tokenizer with right padding, chat template, Qwen2-VL's PIL image processor, model), Qwen-VL's frame / image sizing,
the Qwen2-VL patch layout, the user turn rendered with its vision placeholders expanded and the batch a Qwen2-VL
processor call gives, the reward checkpoints' state dicts (PEFT prefixes, LoRA merged, transformers-4.45 key names),
and the forward the authors wrote themselves (text decoder without position ids) read at the reward tokens. What
each model publishes (prompt texts, special tokens, heads, normalisation) stays in its own file; the ranknet heads
are `heads.head_from_state`.

`smart_resize` is qwen-vl-utils' (sides multiples of `factor`, area in [min_pixels, max_pixels], aspect kept);
`smart_nframes` its frame count for a video of `total` frames at `video_fps` sampled at `fps` (or asked for
`nframes`), as VideoAlign's copy of `vision_process.py` computes it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from .base import image_batch_as_uint8

FRAME_FACTOR = 2  # qwen-vl-utils: frame counts are even
FPS_MIN_FRAMES, FPS_MAX_FRAMES = 4, 768
MAX_RATIO = 200
PEFT_PREFIX = "base_model.model."
IMAGE_FACTOR = 28  # Qwen2-VL: 14-pixel patches merged 2×2
# transformers 4.45 key names (HPSv3.safetensors, VideoReward's files) -> the current Qwen2-VL / Qwen2.5-VL layout
LEGACY_KEYS = ((re.compile(r"^visual\."), "model.visual."),
               (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."))


# ----------------------------------------------------------------------------------------------- the base directory
def chat_template(root: Path, tokenizer, who: str) -> str:
    """The processor's chat template (chat_template.jinja / chat_template.json), else the tokenizer's."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if (root / "chat_template.json").is_file():
        return json.loads((root / "chat_template.json").read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise ValueError(f"{who}: {root} has no chat template (chat_template.jinja / .json or the tokenizer's)")
    return tokenizer.chat_template


def load_base(root: Path, who: str, dtype: torch.dtype) -> tuple:
    """(tokenizer, chat template, image processor, model) of a base directory: the tokenizer with right padding (the
    reward models' processors pad on the right), Qwen2-VL's PIL image processor (the default of transformers 4.45,
    which the reward models pin), the model in `dtype` on the CPU."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(root))
    tokenizer.padding_side = "right"
    template = chat_template(root, tokenizer, who)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(root))
    return tokenizer, template, image_processor, AutoModelForImageTextToText.from_pretrained(str(root), dtype=dtype)


# ----------------------------------------------------------------------------------------------- inputs
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): round each side to a multiple of `factor`; above `max_pixels` scale by √(H·W / max) and floor, below
    `min_pixels` by √(min / (H·W)) and ceil (to the factor)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"an image of {height}x{width} has an aspect ratio above {MAX_RATIO} (Qwen-VL refuses it)")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def rgb_pictures(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [0, 1] -> B PIL RGB images of its uint8 values (what the reward models read from files)."""
    from PIL import Image

    return [Image.fromarray(array).convert("RGB") for array in image_batch_as_uint8(images)]


def resized_picture(picture, pixels: int, factor: int = IMAGE_FACTOR):
    """A PIL image resized with PIL bicubic to `smart_resize`'s size for min_pixels = max_pixels = `pixels`."""
    from PIL import Image

    h, w = smart_resize(picture.height, picture.width, factor, pixels, pixels)
    return picture.resize((w, h), Image.BICUBIC)


def smart_nframes(total: int, video_fps: float, fps: float | None = None, nframes: int | None = None) -> int:
    """How many frames Qwen-VL samples: `nframes` rounded to an even count, else total / video_fps · fps clamped to
    [4, min(768, total)] (bounds made even) and rounded to an even count; never more than `total`."""
    if nframes is not None:
        n = round(nframes / FRAME_FACTOR) * FRAME_FACTOR
    else:
        lo = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        hi = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        n = round(min(max(total / video_fps * fps, lo), hi) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(f"a video of {total} frames gives {n} frames to sample; Qwen-VL needs 2..{total}")
    return int(n)


def uniform_indices(total: int, n: int) -> list[int]:
    """round(linspace(0, total − 1, n)) in float32 with halves to even (torch.linspace(...).round(), as
    qwen-vl-utils samples `uniform`)."""
    return torch.linspace(0, total - 1, n).round().long().tolist()


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 (T, 3, H, W) frames resized as torchvision resizes a uint8 tensor (bicubic, antialias): float, then
    rounded and clamped back to 0..255; returned as float (the values of the uint8 result)."""
    out = torch.nn.functional.interpolate(frames.float(), size=size, mode="bicubic", align_corners=False,
                                          antialias=True)
    return out.clamp(0, 255).round()


def qwen_patches(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2-VL's flattened patches of normalised frames (T, C, H, W): T padded to a multiple of `temporal` with the
    last frame, then (grid_t·grid_h·grid_w, C·temporal·patch²) with the patches of each merge×merge block adjacent
    (the image processor's layout), and [grid_t, grid_h, grid_w]."""
    t, c, h, w = frames.shape
    if t % temporal:
        frames = torch.cat([frames, frames[-1:].expand(temporal - t % temporal, -1, -1, -1)])
        t = frames.shape[0]
    gt, gh, gw = t // temporal, h // patch, w // patch
    if gh * patch != h or gw * patch != w or gh % merge or gw % merge:
        raise ValueError(f"a frame of {h}x{w} is not a multiple of {patch * merge} pixels")
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch), [gt, gh, gw]


def render_turn(tokenizer, template: str, content: list[dict], placeholder: str, counts: list[int], who: str) -> str:
    """One user turn `content` in the chat template with the generation prompt, the i-th `placeholder` repeated
    counts[i] times (grid_t·grid_h·grid_w / merge² tokens, as Qwen2-VL's processor expands them)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                         tokenize=False, add_generation_prompt=True)
    parts = text.split(placeholder)
    if len(parts) != len(counts) + 1:
        raise ValueError(f"{who}: the chat template renders {len(parts) - 1} {placeholder} placeholders for "
                         f"{len(counts)} inputs")
    return parts[0] + "".join(placeholder * n + part for n, part in zip(counts, parts[1:], strict=True))


def model_inputs(tokenizer, texts: list[str], kind: str, pixels: torch.Tensor, grids: torch.Tensor, device,
                 dtype: torch.dtype) -> dict:
    """The batch a Qwen2-VL processor call gives: the texts tokenized with padding, the patches and their grids
    under `kind`'s names (pixel_values / image_grid_thw, or pixel_values_videos / video_grid_thw)."""
    tok = tokenizer(texts, padding=True, return_tensors="pt")
    values, grid = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
    return {"input_ids": tok.input_ids.to(device), "attention_mask": tok.attention_mask.to(device),
            values: pixels.to(device, dtype), grid: grids.to(device)}


# ----------------------------------------------------------------------------------------------- checkpoints
def current_key(key: str) -> str:
    """A transformers-4.45 Qwen2-VL key in the current layout (current keys pass unchanged)."""
    for pattern, replacement in LEGACY_KEYS:
        if pattern.match(key):
            return pattern.sub(replacement, key, count=1)
    return key


def load_state(file: Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch pickle of tensors (loaded with weights_only: no code runs); a
    `{"model": state}` wrapper is opened."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (a pickle with code, or not a torch file)
            raise ValueError(f"{file}: not a state dict of tensors ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file}: not a state dict of tensors")
    return state


def merged_state(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor], scale: float) -> dict:
    """A reward checkpoint's tensors in the current model's key names, LoRA merged: the PEFT prefix
    `base_model.model.` and `.base_layer` dropped, legacy (transformers 4.45) names renamed (`current_key`), and each
    pair `<m>.lora_A[.<adapter>].weight` / `<m>.lora_B[...]` folded into `<m>.weight` as W + scale · B·A (W from the
    checkpoint when it holds it, else `base`: the model's own weights)."""
    plain, lora_a, lora_b = {}, {}, {}
    for key, value in state.items():
        key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        key = key.replace(".base_layer.", ".")
        parts = key.split(".")
        for mark, into in (("lora_A", lora_a), ("lora_B", lora_b)):
            if mark in parts:
                at = parts.index(mark)
                into[current_key(".".join(parts[:at]))] = value
                break
        else:
            if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
                raise ValueError(f"checkpoint key {key}: LoRA on an embedding is not supported")
            plain[current_key(key)] = value
    if set(lora_a) != set(lora_b):
        raise ValueError(f"LoRA A and B matrices do not pair up (e.g. {sorted(set(lora_a) ^ set(lora_b))[:2]})")
    for module, a in lora_a.items():
        name = module + ".weight"
        weight = plain.get(name, base.get(name))
        if weight is None:
            raise ValueError(f"a LoRA adapter for {module}, which the model does not have")
        delta = (lora_b[module].double() @ a.double()) * scale
        plain[name] = (weight.double() + delta).to(weight.dtype)
    return plain


# ----------------------------------------------------------------------------------------------- forward
def special_hidden(model, batch: dict, kind: str) -> torch.Tensor:
    """The authors' forward (VideoAlign's Qwen2VLRewardModelBT, EditReward's heads, HPSv3): token embeddings with the
    vision tower's merged patches scattered into the `kind` placeholders ("image" / "video"), then the text decoder
    with no position ids, i.e. positions 0..L−1 on all three M-RoPE axes (never Qwen-VL's 2-D vision positions).
    Returns the final-norm hidden states (B, L, D)."""
    inner, ids = model.model, batch["input_ids"]
    embeds = model.get_input_embeddings()(ids)
    if kind == "video":
        out = inner.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])
        token = model.config.video_token_id
    else:
        out = inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        token = model.config.image_token_id
    patches = torch.cat(list(out.pooler_output))
    mask = (ids == token).unsqueeze(-1).expand_as(embeds)
    if int(mask[..., 0].sum()) != patches.shape[0]:
        raise ValueError(f"{int(mask[..., 0].sum())} {kind} placeholders for {patches.shape[0]} merged patches")
    embeds = embeds.masked_scatter(mask, patches.to(embeds.dtype))
    return inner.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state


def token_states(model, batch: dict, kind: str, token_id: int, token: str, who: str) -> torch.Tensor:
    """(B, D): `special_hidden` at the reward token, which each sample must hold exactly once."""
    ids = batch["input_ids"]
    if not bool(((ids == token_id).sum(1) == 1).all()):
        raise ValueError(f"{who}: each sample must hold exactly one {token} token (a prompt containing it?)")
    return special_hidden(model, batch, kind)[ids == token_id]
