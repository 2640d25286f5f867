"""The engine seam: what the trainer and actor need from "the other ranks", and nothing else.

`LocalEngine` is one process (every collective is the identity). `DataParallelEngine` runs one replica of the
trainable weights per rank (`torchrun --nproc-per-node=N -m polyrl train ...`): each rank samples and scores
its contiguous share of the step's prompt groups, the actor sums gradients over ranks after each mini-batch
(the losses are already normalised by the *global* mini-batch size, so the sum is the 1-process gradient), and
only rank 0 logs and writes. gloo on CPUs, NCCL on GPUs (one GPU per rank, `cuda:LOCAL_RANK`).

Gradients travel as one flat buffer per bucket of at most `BUCKET_NUMEL` elements (what DDP does, without
wrapping the model: the adapters call their networks directly, and LoRA-only gradients are small).

`FSDP2Engine` (distributed/fsdp2.py, `actor.backend=fsdp2`) shards the weights and adds sequence and tensor
parallel ranks that share samples; the trainer sees the same methods, where `shard`, `gather` and `sum` run over
the data-parallel ranks (`dp_rank`, `dp_size`) and `sharded` says that a forward needs every rank.
"""

from __future__ import annotations

import os

import torch

from .dims import ParallelDims, shard_range

BUCKET_NUMEL = 64 * 2**20


class LocalEngine:
    """One process: rank 0 of a world of 1."""

    rank, world_size = 0, 1
    dims = ParallelDims()
    sharded = False  # True: the weights are spread over the ranks, so every forward and save needs every rank

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (ranks that hold different samples)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This rank's contiguous share of n items (prompt groups, samples)."""
        return shard_range(n, self.dp_rank, self.dp_size)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks (equal shapes) along dim 0."""
        return t

    def gather_objects(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj):
        return obj

    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        pass

    def barrier(self) -> None:
        pass

    def close(self, barrier: bool = True) -> None:
        """End the process group; `barrier`: first wait for every rank (False after a failure: a rank may be gone)."""


class DataParallelEngine(LocalEngine):
    def __init__(self, device_name: str = "auto"):
        import torch.distributed as dist

        self.dist = dist
        cuda = pick_device(device_name).type == "cuda"
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            init_process_group("nccl" if cuda else "gloo")
        super().__init__(device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims(dp=self.world_size)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Σ over ranks of every parameter's gradient (None counts as zeros: a rank may hold no sample of a
        mini-batch), in flat buckets."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            bucket.append(p.grad)
            size += p.grad.numel()
            if size >= BUCKET_NUMEL:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.device, copy=True)  # NCCL reduces device tensors only
        self.dist.all_reduce(out)
        return out.to(t.device)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.dist.all_gather(parts, local)
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values everywhere (replicas must start equal, whatever each rank's initialisation drew)."""
        with torch.no_grad():
            for p in params:
                self.dist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self, barrier: bool = True) -> None:
        if self.dist.is_initialized():
            if barrier:
                self.dist.barrier()  # no rank tears the group down while another still talks to it
            self.dist.destroy_process_group()


def init_process_group(backend: str) -> None:
    """The process group of a torchrun launch. Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) its keys
    are prefixed with the restart count: torch keeps one store for the whole launch, and the group that
    `--max-restarts` starts again would read the dead attempt's addresses (gloo: `connectFullMesh failed ...
    Connection refused`, seen with torch 2.13)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    from torch.distributed.constants import default_pg_timeout

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=default_pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"polyrl/attempt_{attempt}", store), rank=rank,
                            world_size=world)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    return torch.device(name)
