from .base import REWARDS, Reward, RewardOutput, build_reward, register_reward
from . import jpeg, shapes  # noqa: F401  (register the built-in scorers)

__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward", "register_reward"]
