"""The parallel layout of a run: data (dp = dp_replicate × dp_shard), sequence (sp) and tensor (tp) parallel
degrees over the world, and the one place where a layout is checked.

At world size 1 every `*_enabled` flag is false and nothing else in the code needs to know about ranks (the
torchtitan `ParallelDims` pattern). The mesh is (dp_replicate, dp_shard, sp, tp), tp innermost: the ranks of one
tensor-parallel group are neighbours (one node's fast links), then the sequence-parallel ones. The ranks of one
sp × tp group hold the same samples (a "replica" of the data); data is split over dp only.

`resolve_dims` turns the `parallel.*` keys into a layout or a one-line error naming the keys, before any process
group exists: a wrong combination is a config error, never a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1  # data-parallel degree, dp_replicate × dp_shard
    sp: int = 1
    tp: int = 1
    dp_replicate: int = 1  # of the dp ranks, how many groups hold a full copy each (HSDP); the rest shard

    def __post_init__(self):
        for name in ("dp", "sp", "tp", "dp_replicate"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel degree {name}={getattr(self, name)} must be >= 1")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp={self.dp} is not a multiple of dp_replicate={self.dp_replicate}")

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

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

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.sp, self.tp)

    @classmethod
    def from_env(cls) -> ParallelDims:
        """All ranks of a `torchrun` launch (WORLD_SIZE) as data-parallel replicas."""
        return cls(dp=world_size_from_env())


MESH_DIMS = ("dp_replicate", "dp_shard", "sp", "tp")
SHARDED_BACKENDS = ("fsdp2", "veomni")  # actor.backend values that read parallel.* (veomni: dp_* only, plan.py)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def shard_range(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous share of n items (n divisible by world)."""
    if n % world:
        raise ValueError(f"{n} items cannot be split evenly over {world} ranks")
    per = n // world
    return range(rank * per, (rank + 1) * per)


def resolve_dims(parallel, backend: str, world_size: int, model_name: str = "", plan: dict | None = None,
                 heads: int | None = None) -> ParallelDims:
    """The layout for `parallel` (keys dp_replicate, dp_shard (-1: the rest of the world), sp, tp) on `world_size`
    ranks; ValueError with a one-line message naming the keys when the combination cannot run.

    `plan` is the model's parallel plan (its class attribute `parallel_plan`, None when it has none) and `heads` its
    attention heads (None when unknown before loading): sp and tp split heads, so heads % (sp × tp) must be 0.
    """
    rep, shard, sp, tp = (int(parallel[k]) for k in ("dp_replicate", "dp_shard", "sp", "tp"))
    for key, value in (("dp_replicate", rep), ("sp", sp), ("tp", tp)):
        if value < 1:
            raise ValueError(f"parallel.{key}={value} must be >= 1")
    if shard == 0 or shard < -1:
        raise ValueError(f"parallel.dp_shard={shard} must be >= 1, or -1 (the ranks left by dp_replicate × sp × tp)")
    if backend not in SHARDED_BACKENDS:
        changed = [f"parallel.{k}={v}" for k, v in (("dp_replicate", rep), ("sp", sp), ("tp", tp)) if v != 1]
        changed += [f"parallel.dp_shard={shard}"] if shard not in (-1, world_size) else []
        if changed:
            raise ValueError(f"{', '.join(changed)} needs actor.backend=fsdp2 (actor.backend={backend} replicates the "
                             f"weights on every rank: plain data parallel over all {world_size} ranks)")
        return ParallelDims(dp=world_size)
    fixed = rep * sp * tp
    if shard == -1:
        if world_size % fixed:
            raise ValueError(f"world size {world_size} is not a multiple of parallel.dp_replicate × parallel.sp × "
                             f"parallel.tp = {rep} × {sp} × {tp} = {fixed}")
        shard = world_size // fixed
    if rep * shard * sp * tp != world_size:
        how = ("launch with `torchrun --nproc-per-node=N -m polyrl train ...`" if world_size == 1
               else "change the parallel.* keys or the number of processes")
        raise ValueError(f"world size {world_size} != parallel.dp_replicate × parallel.dp_shard × parallel.sp × "
                         f"parallel.tp = {rep} × {shard} × {sp} × {tp} = {rep * shard * sp * tp}; {how}")
    if (sp > 1 or tp > 1) and plan is None:
        keys = " and ".join(f"parallel.{k}={v}" for k, v in (("sp", sp), ("tp", tp)) if v > 1)
        raise ValueError(f"{keys}: model.name={model_name} has no parallel plan (no sequence or tensor parallel "
                         f"support); use parallel.dp_shard / parallel.dp_replicate only")
    if sp > 1 and not (plan or {}).get("sequence"):
        raise ValueError(f"parallel.sp={sp}: model.name={model_name} has no sequence-parallel plan")
    if tp > 1 and not (plan or {}).get("tensor"):
        raise ValueError(f"parallel.tp={tp}: model.name={model_name} has no tensor-parallel plan")
    if heads is not None and heads % (sp * tp):
        raise ValueError(f"parallel.sp × parallel.tp = {sp} × {tp} = {sp * tp} does not divide the model's {heads} "
                         f"attention heads (each rank computes whole heads)")
    return ParallelDims(dp=rep * shard, sp=sp, tp=tp, dp_replicate=rep)
