# importing a family's file registers its models (flux: + flux_kontext; qwen_image_edit: + qwen_image_edit_plus)
from . import flux, flux2, qwen_image, qwen_image_edit, sd3, wan  # noqa: F401
from .base import MODELS, Cond, DiffusionPolicy, Guidance, Prompt, build_model, register_model

__all__ = ["MODELS", "Cond", "DiffusionPolicy", "Guidance", "Prompt", "build_model", "register_model"]
