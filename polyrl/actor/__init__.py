"""The actor backends: `local` (weights replicated on every rank), `fsdp2` (sharded; actor/fsdp2.py) and `veomni`
(fsdp2 with VeOmni's parallel state and FSDP2 wrapping; actor/veomni.py); a token policy's actor re-scores tokens
(actor/tokens.py)."""

from __future__ import annotations


def actor_class(backend: str, kind: str = "diffusion"):
    """The actor class of `actor.backend` for a policy of `kind` (models/base.py policy_kind); fsdp2 and veomni
    are imported only when asked for."""
    if kind == "tokens":
        from .tokens import TokenActor

        return TokenActor
    if backend == "fsdp2":
        from .fsdp2 import FSDP2Actor

        return FSDP2Actor
    if backend == "veomni":
        from .veomni import VeOmniActor

        return VeOmniActor
    from .local import LocalActor

    return LocalActor
