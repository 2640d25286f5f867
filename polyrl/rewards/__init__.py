from . import jpeg, shapes  # noqa: F401  (register the built-in scorers)
from .base import REWARDS, Reward, RewardOutput, build_reward, register_reward

__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward", "register_reward"]
