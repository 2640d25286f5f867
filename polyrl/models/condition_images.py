"""Condition images of a prompt (the data file's `image` column, resolved by data/prompts.py): the paths a prompt
carries, checked against what a model takes, and the image itself as RGB. Shared by the image-edit models
(qwen_image_edit, flux_kontext) and image-to-video (wan_i2v)."""

from __future__ import annotations

from .base import Prompt, prompt_text


def condition_paths(prompt: Prompt, family: str, max_images: int | None) -> tuple[str, list[str]]:
    """The instruction and the condition image paths of a prompt; a prompt without images is an error."""
    if isinstance(prompt, str) or not prompt.get("images"):
        raise ValueError(f"{family} edits a condition image, but the prompt {prompt_text(prompt)!r} carries none "
                         "(each data row needs an `image` column: a path or a list of paths)")
    extra = sorted(set(prompt) - {"text", "images"})
    if extra:
        raise ValueError(f"{family} reads text and images; the prompt also carries {extra}")
    images = list(prompt["images"])
    if max_images is not None and len(images) > max_images:
        raise ValueError(f"{family} takes {max_images} condition image per prompt, got {len(images)} "
                         "(model.name=qwen_image_edit_plus takes several)")
    return prompt["text"], [str(p) for p in images]


def load_rgb(path: str):
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError as e:
        raise ValueError(f"condition image {path}: {e}") from None
