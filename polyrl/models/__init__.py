# importing a family's file registers its models (flux: + flux_kontext; qwen_image_edit: + qwen_image_edit_plus)
# causal_lm: the token policy of any transformers causal LM (docs/tokens.md)
from . import ace_step, causal_lm, flux, flux2, ltx2, qwen_image, qwen_image_edit, sd3, stable_audio, stable_audio3, wan  # noqa: F401
from .bagel import BagelPolicy  # noqa: F401  (model=bagel: BAGEL-7B-MoT text-to-image)
from .base import MODELS, Cond, DiffusionPolicy, Guidance, Prompt, build_model, register_model
from .diffusers_pipeline import PipelinePolicy  # noqa: F401  (model=diffusers_pipeline: any diffusers flow-matching pipeline)
from .hunyuan_image import HunyuanImagePolicy  # noqa: F401
from .janus_pro import JanusProPolicy  # noqa: F401  (model=janus_pro: image tokens as a token policy)
from .minimax_h3 import MiniMaxH3Policy  # noqa: F401  (model=minimax_h3: joint video + audio, t2va / fl2va / ref2va)
from .qwen3_omni import Qwen3OmniPolicy  # noqa: F401  (model=qwen3_omni: the Qwen3-Omni thinker, text out)
from .qwen3_omni_speech import Qwen3OmniSpeechPolicy  # noqa: F401  (model=qwen3_omni_speech: thinker + talker, text and speech)
from .qwen3_tts import Qwen3TTSPolicy  # noqa: F401  (model=qwen3_tts: Qwen3-TTS codec tokens, speech out)
from .wan_i2v import WanI2VPolicy  # noqa: F401  (model=wan_i2v: Wan2.2-TI2V-5B / I2V-A14B image-to-video)
from .z_image import ZImagePolicy  # noqa: F401

__all__ = ["MODELS", "Cond", "DiffusionPolicy", "Guidance", "Prompt", "build_model", "register_model"]
