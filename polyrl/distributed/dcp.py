"""Sharded checkpoints (torch.distributed.checkpoint) of the actor's trainable state, by parameter name.

`actor.backend=fsdp2` writes its trainable weights, the EMA / old copy, the evaluation EMA and the AdamW state into
`<checkpoint>/distcp/`:
every rank writes its own shards in parallel, and a later run loads them into whatever layout it has (another
world size, another sharding, or plain tensors in one process: DCP reshards on load). The keys are
`weights/<network>.<parameter>`, `old/<network>.<parameter>`, `eval_ema/<network>.<parameter>` and `optimizer/<network>.<parameter>/<state>`, so they
do not depend on the layout either. The single-process format (safetensors + the optimizer's `state_dict()` in
trainer_state.pt) is converted here too: `shard_like` places a full tensor into a parameter's layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

DCP_DIR = "distcp"


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` in the layout of `like`: this rank's shard of it for a DTensor (cut locally: every rank holds the full
    tensor already), else `full` on like's device and dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # ~1 s of import: only when sharding

    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def adam_state(optimizer: torch.optim.Optimizer, names: list[str], params: list[torch.Tensor]) -> dict:
    """AdamW's per-parameter state keyed by name, created (zeros, step 0) where the optimizer has not stepped yet
    so that a load has tensors to fill."""
    out = {}
    for name, p in zip(names, params, strict=True):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[name] = state
    return out


def actor_tensors(actor) -> dict:
    """Every tensor of the actor's trainable state, keyed by layout-free names (see the module docstring)."""
    state = {"weights": dict(zip(actor.param_names, actor.params, strict=True)),
             "optimizer": adam_state(actor.optimizer, actor.param_names, actor.params)}
    if actor.old_params is not None:
        state["old"] = dict(zip(actor.param_names, actor.old_params, strict=True))
    if getattr(actor, "eval_params", None) is not None:  # the evaluation EMA (actor.eval_ema_decay)
        state["eval_ema"] = dict(zip(actor.param_names, actor.eval_params, strict=True))
    return state


def save_sharded(directory: Path, state: dict) -> None:
    """Every rank writes its shards of `state` under `directory` (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(directory: Path, state: dict) -> None:
    """Fill the tensors of `state` in place from `directory`, in their own layout (plain tensors in one process
    without a process group too)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory}: no sharded checkpoint there")
    try:
        dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException: made an ordinary error naming the first failure
        first = next(iter(e.failures.values()), None)
        cause = first[0] if isinstance(first, tuple) else first
        text = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else str(e)[:300]
        raise ValueError(f"{directory}: {type(cause).__name__}: {text}") from None
