from . import (  # noqa: F401  (register; dapo, dpo_tokens, grpo_tokens, gspo, opd_tokens: the token-policy losses)
    awm,
    dapo,
    dgpo,
    diffusion_dpo,
    diffusion_nft,
    diffusion_opd,
    dpo_tokens,
    flow_dppo,
    flow_grpo,
    grpo_guard,
    grpo_tokens,
    gspo,
    opd_tokens,
)
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
