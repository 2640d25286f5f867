"""`actor.backend=veomni`: the fsdp2 actor (actor/fsdp2.py) whose networks are sharded by VeOmni's
`build_parallelize_model` on VeOmni's parallel state (distributed/veomni.py) instead of polyrl's own `fully_shard`
calls. Policy contexts, micro-batch lockstep, clipping and sharded checkpoints are the fsdp2 actor's."""

from __future__ import annotations

import torch

from ..distributed.veomni import parallelize_with_veomni
from .fsdp2 import FSDP2Actor


class VeOmniActor(FSDP2Actor):
    def _parallelize(self, network: torch.nn.Module, plan: dict | None, dtype: torch.dtype) -> list[torch.nn.Module]:
        return parallelize_with_veomni(network, plan, self.engine, dtype)
