from . import aesthetic, clip_score, http, jpeg, latent, mix, ocr, pickscore, shapes  # noqa: F401  (register the built-in scorers)
from .base import (
    REWARDS,
    Audio,
    Reward,
    RewardOutput,
    build_reward,
    call_reward,
    media_kind,
    register_reward,
    reward_inputs,
)

__all__ = ["REWARDS", "Audio", "Reward", "RewardOutput", "build_reward", "call_reward", "media_kind",
           "register_reward", "reward_inputs"]
