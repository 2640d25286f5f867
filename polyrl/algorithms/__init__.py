from . import diffusion_dpo, diffusion_nft, diffusion_opd, flow_dppo, flow_grpo, grpo_guard  # noqa: F401  (register)
from .base import (
    ALGORITHMS,
    POLICIES,
    Algorithm,
    AlgorithmBase,
    PolicyEvaluator,
    build_algorithm,
    compute_advantages,
    register_algorithm,
)

__all__ = ["ALGORITHMS", "POLICIES", "Algorithm", "AlgorithmBase", "PolicyEvaluator", "build_algorithm",
           "compute_advantages", "register_algorithm"]
