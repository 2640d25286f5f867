from . import flow_grpo  # noqa: F401  (registers "flow_grpo")
from .base import ALGORITHMS, Algorithm, PolicyEvaluator, build_algorithm, compute_advantages, register_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "PolicyEvaluator", "build_algorithm", "compute_advantages", "register_algorithm"]
