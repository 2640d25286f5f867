"""The rollout stage of every policy kind (sampling/base.py PolicySampler)."""


def sampler_class(kind: str):
    """The PolicySampler class of a policy kind (models/base.py policy_kind)."""
    from . import diffusion, tokens  # noqa: F401  (register)
    from .base import SAMPLERS

    return SAMPLERS[kind]
