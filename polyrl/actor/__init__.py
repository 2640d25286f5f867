"""The actor backends: `local` (weights replicated on every rank) and `fsdp2` (sharded; actor/fsdp2.py)."""

from __future__ import annotations


def actor_class(backend: str):
    """The actor class of `actor.backend` (fsdp2 is imported only when asked for)."""
    if backend == "fsdp2":
        from .fsdp2 import FSDP2Actor

        return FSDP2Actor
    from .local import LocalActor

    return LocalActor
