from . import qwen_image, sd3  # noqa: F401  (register "qwen_image", "sd3")
from .base import MODELS, Cond, GeneratorAdapter, build_model, register_model

__all__ = ["MODELS", "Cond", "GeneratorAdapter", "build_model", "register_model"]
