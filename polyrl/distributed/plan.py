"""A model's parallel plan: plain data in the model file, read here (models never import distributed code).

A policy class may set `parallel_plan = {network name: plan}`; a plan is a dict with
- `blocks`: the attribute holding the network's repeated blocks (the FSDP2 and activation-checkpointing units);
- `heads`: the network config key with its attention heads (sp and tp split heads);
- `sequence` (Ulysses sp): `split` {module: stream} (each module's output (B, S, D) is a token stream, split over
  the sp ranks after padding to a multiple of sp; an output tuple is split element by element, e.g. a rotary
  table (cos, sin) of the stream's tokens), `split_inputs` {module: {forward argument: stream}} (optional: those
  arguments, by keyword or position, split before the module runs, for tokens made inside a forward rather than by
  a module of their own, e.g. Wan's video tokens at its first block; module "" is the network itself), `gather`
  {module: stream} (outputs gathered back to the full stream), `attention` {block-relative attention module: the
  streams its sequence holds, in order}: their scaled-dot-product attention becomes the all-to-all one (an
  attention whose keys are whole on every rank, e.g. a cross-attention to text, is left out). Whatever is split
  into one stream is padded alike; a tensor of one dimension (B,) carries no tokens and passes whole (a per-sample
  timestep where a per-token one (B, S) would be split);
- `tensor` (tp): `colwise` / `rowwise` (block-relative linears: heads and MLP hidden columns split, outputs summed),
  `heads` (block-relative attention modules whose `heads` attribute becomes the local count), `local_grads`
  (block-relative modules that act on one rank's heads, e.g. per-head q/k RMS norms: their replicated weights get
  a gradient from local heads only, summed over tp after each backward).

`check_parallel_config` validates a run's `parallel.*` keys against the world size and the model before anything
starts (config/schema.py calls it).
"""

from __future__ import annotations

import json
from pathlib import Path

from .dims import SHARDED_BACKENDS, ParallelDims, resolve_dims, world_size_from_env


def model_plans(model_cls) -> dict[str, dict] | None:
    return getattr(model_cls, "parallel_plan", None)


def model_heads(model_path, plans: dict[str, dict] | None) -> int | None:
    """The smallest head count over the planned networks, read from `<model.path>/<network>/config.json` (None
    when the checkpoint is not there yet: the count is checked again when the model is built)."""
    found = []
    for name, plan in (plans or {}).items():
        config = Path(str(model_path)) / name / "config.json"
        try:
            found.append(int(json.loads(config.read_text())[plan["heads"]]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return min(found) if found else None


def check_parallel_config(cfg, model_cls, world_size: int | None = None) -> ParallelDims:
    """The run's layout, or ValueError with one line naming the keys (see `resolve_dims`)."""
    plans = model_plans(model_cls)
    world = world_size_from_env() if world_size is None else world_size
    heads = model_heads(cfg.model.path, plans)
    dims = resolve_dims(cfg.parallel, cfg.actor.backend, world, cfg.model.name, _combined(plans), heads)
    if dims.sp_enabled and cfg.model.compile != "none":
        raise ValueError(f"parallel.sp={dims.sp} with model.compile={cfg.model.compile}: the sequence-parallel "
                         "attention is not traced by torch.compile here; use model.compile=none")
    backend = cfg.actor.backend
    kind = getattr(model_cls, "policy_kind", "diffusion")
    if backend in SHARDED_BACKENDS and kind != "diffusion":
        raise ValueError(f"actor.backend={backend} trains diffusion policies; model.name={cfg.model.name} is a {kind} "
                         "policy: use actor.backend=local (data parallel under torchrun)")
    if backend in SHARDED_BACKENDS and cfg.model.get("fp8") is True:
        raise ValueError(f"model.fp8=true with actor.backend={backend}: float8 base layers are not sharded here; use "
                         "actor.backend=local")
    if backend == "veomni":
        split = [f"parallel.{k}={v}" for k, v in (("sp", dims.sp), ("tp", dims.tp)) if v > 1]
        if split:
            raise ValueError(f"{' and '.join(split)} with actor.backend=veomni: only VeOmni's data-parallel sharding "
                             "is wired here (parallel.dp_shard, parallel.dp_replicate); use actor.backend=fsdp2 for "
                             "sequence or tensor parallel")
        if dims.world_size == 1:
            raise ValueError("actor.backend=veomni shards over 2 or more ranks (VeOmni's parallelizer leaves a world "
                             "of 1 unsharded): launch with `torchrun --nproc-per-node=N -m polyrl train ...`, or use "
                             "actor.backend=fsdp2 in one process")
    return dims


def _combined(plans: dict[str, dict] | None) -> dict | None:
    """One plan's capabilities for the whole model: sequence / tensor only when every network has them."""
    if not plans:
        return None
    return {"sequence": all(p.get("sequence") for p in plans.values()),
            "tensor": all(p.get("tensor") for p in plans.values())}
