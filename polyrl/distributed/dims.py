"""The parallel layout of a run: data (dp), sequence (sp) and tensor (tp) parallel degrees over the world.

At world size 1 every `*_enabled` flag is false and nothing else in the code needs to know about ranks (the
torchtitan `ParallelDims` pattern). This step implements data parallelism; sp and tp are declared so that the
scale-out work adds their meshes here without touching the callers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    sp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("dp", "sp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel degree {name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @classmethod
    def from_env(cls) -> ParallelDims:
        """All ranks of a `torchrun` launch (WORLD_SIZE) as data-parallel replicas."""
        return cls(dp=int(os.environ.get("WORLD_SIZE", "1")))


def shard_range(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous share of n items (n divisible by world)."""
    if n % world:
        raise ValueError(f"{n} items cannot be split evenly over {world} ranks")
    per = n // world
    return range(rank * per, (rank + 1) * per)
