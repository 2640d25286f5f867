from . import (  # noqa: F401  (register the built-in scorers)
    aesthetic,
    clap,
    clip_score,
    geneval,
    hps,
    http,
    jpeg,
    latent,
    mix,
    motion,
    ocr,
    pickscore,
    preservation,
    rules,
    shapes,
    temporal_consistency,
    vlm_judge,
)
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
