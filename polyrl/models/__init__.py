from . import qwen_image, sd3, wan  # noqa: F401  (register "qwen_image", "sd3", "wan")
from .base import MODELS, Cond, DiffusionPolicy, Guidance, Prompt, build_model, register_model

__all__ = ["MODELS", "Cond", "DiffusionPolicy", "Guidance", "Prompt", "build_model", "register_model"]
