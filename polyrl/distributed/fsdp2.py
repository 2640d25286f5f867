"""`actor.backend=fsdp2`: the engine over a (dp_replicate, dp_shard, sp, tp) device mesh and the parallelization of
a plain network from outside (torchtitan's order: tensor parallel, sequence parallel, then `fully_shard` per block
and at the root), driven by the model's plan (distributed/plan.py).

Meshes: the weights are sharded over dp_shard × sp (the sp ranks hold the same samples but different tokens, so
their gradients are partial sums too) and replicated over dp_replicate (HSDP); tensor-parallel weights are 2-D
DTensors (FSDP shard × tp). Every FSDP unit's gradient reduction is a plain sum (divide factor 1): the actor's
losses are already normalised by the global mini-batch, so the sum over data ranks is the 1-process gradient, and
the sum over sp ranks adds up the tokens.

Mixed precision is FSDP2's `MixedPrecisionPolicy`: parameters are gathered in the model's dtype (bfloat16 for a
bfloat16 run; the trainable ones are kept in float32 as the optimizer's master copy) and gradients are reduced in
float32. Forward inputs are not cast: every block gets what it gets with the local backend (autocast sets the
compute dtype).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .dims import ParallelDims
from .engine import DataParallelEngine, pick_device


class FSDP2Engine(DataParallelEngine):
    """The ranks of a run with sharded weights: `shard` / `gather` / `gather_objects` / `sum` run over the
    data-parallel ranks, `broadcast_object` and `barrier` over every rank."""

    sharded = True

    def __init__(self, device_name: str, dims: ParallelDims):
        if not dist.is_initialized() and "RANK" not in os.environ:  # world size 1 without torchrun: a 1-rank group
            cuda = pick_device(device_name).type == "cuda"
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        super().__init__(device_name)
        if self.world_size != dims.world_size:  # checked with the config already; WORLD_SIZE may lie
            raise RuntimeError(f"{self.world_size} ranks but the parallel layout needs {dims.world_size}")
        self.dims = dims
        self._build_meshes(dims)

    def _build_meshes(self, dims: ParallelDims) -> None:
        """`fsdp_mesh` (what FSDP2 shards over), `dp_mesh` / `dp_group` (the ranks holding different samples),
        `sp_group`, `tp_mesh` and `replica_group` (the sp × tp ranks sharing samples; None without sp or tp)."""
        from torch.distributed.device_mesh import init_device_mesh

        root = init_device_mesh(self.device.type, (dims.dp_replicate, dims.dp_shard * dims.sp, dims.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard_sp", "tp"))
        # FSDP2 shards over dp_shard × sp and replicates over dp_replicate; TP DTensors live on the same root mesh
        self.fsdp_mesh = root["dp_replicate", "dp_shard_sp"] if dims.dp_replicate > 1 else root["dp_shard_sp"]
        self.tp_mesh = root["tp"]
        full = root._unflatten(1, (dims.dp_shard, dims.sp), ("dp_shard", "sp"))
        self.sp_group = full["sp"].get_group()
        # slice in the mesh's own dimension order (torch versions differ in where _unflatten puts the new dims)
        in_order = lambda *names: tuple(n for n in full.mesh_dim_names if n in names)  # noqa: E731
        self.dp_mesh = full[in_order("dp_replicate", "dp_shard")]._flatten("dp")
        self.dp_group = self.dp_mesh.get_group()
        # the ranks that share samples (only used when sp × tp > 1)
        self.replica_group = (full[in_order("sp", "tp")]._flatten("sp_tp").get_group()
                              if dims.sp * dims.tp > 1 else None)

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over data-parallel replicas; a replica's value is the max over its sp × tp ranks (they hold the same
        value; a stop flag raised on one of them is seen by all)."""
        out = t.to(self.device, copy=True)
        if self.dims.sp * self.dims.tp > 1:
            self.dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.replica_group)
        self.dist.all_reduce(out, group=self.dp_group)
        return out.to(t.device)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.dp_size)]
        self.dist.all_gather(parts, local, group=self.dp_group)
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        out = [None] * self.dp_size
        self.dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Nothing: FSDP2 reduces every gradient in the backward."""

    def sum_over_tp(self, params: list[torch.nn.Parameter]) -> None:
        """Σ over the tp ranks of gradients computed from local heads only (distributed/tp.py)."""
        if self.dims.tp == 1:
            return
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                self.dist.all_reduce(g, group=self.tp_mesh.get_group())


def blocks_of(network: torch.nn.Module, plan: dict | None) -> list[torch.nn.Module]:
    """The FSDP units below the root: the plan's blocks, else every block of the network's ModuleLists."""
    if plan is not None:
        return list(getattr(network, plan["blocks"]))
    return [b for m in network.children() if isinstance(m, torch.nn.ModuleList) for b in m]


def parallelize(network: torch.nn.Module, plan: dict | None, engine: FSDP2Engine,
                param_dtype: torch.dtype) -> list[torch.nn.Module]:
    """Tensor parallel, sequence parallel and FSDP2 on `network`, in place (its trainable parameters already in
    float32 and equal on every rank). Returns the modules whose gradients are summed over tp (distributed/tp.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    local_grads: list[torch.nn.Module] = []
    if engine.dims.tp_enabled:
        from .tp import apply_tensor_parallel

        local_grads = apply_tensor_parallel(network, plan, engine.tp_mesh)
    if engine.dims.sp_enabled:
        from .ulysses import apply_sequence_parallel

        apply_sequence_parallel(network, plan, engine.sp_group)
    # inputs are left as the network makes them (autocast picks the compute dtype, as with the local backend): FSDP2
    # casting them to param_dtype before a block's forward but (torch < 2.13) not before its recompute under
    # activation checkpointing made the recompute differ from the forward (CheckpointError on the GPU)
    mp = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                              reduce_dtype=torch.float32, cast_forward_inputs=False)
    # one rank holds everything anyway: keep the gathered weights between forwards instead of copying them again
    reshard = engine.fsdp_mesh.size() > 1
    for block in blocks_of(network, plan):
        fully_shard(block, mesh=engine.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(network, mesh=engine.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    reduce_by_sum(network)
    return local_grads


def reduce_by_sum(network: torch.nn.Module) -> None:
    """Every FSDP unit of `network` reduces its gradients as a plain sum over ranks (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    for module in network.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # no division by the number of ranks, as a plain
            module.set_force_sum_reduction_for_comms(True)  # SUM (gloo has no PREMUL_SUM; nothing to scale)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` for parameters sharded on different meshes (FSDP only, FSDP × TP): the 2-norm of
    every gradient together, each group of equally placed DTensors reduced once; grads scaled by
    min(1, max_norm / (norm + 1e-6)) as torch does. Returns the norm (a plain tensor, equal on every rank)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    squares = []
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        squares.append((norm.full_tensor() if key is not None else norm).float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in groups.values():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return total
