"""`actor.backend=fsdp2`: `LocalActor`'s policy contexts and update loop over sharded networks (FSDP2, with sequence
and tensor parallel from the model's plan; distributed/fsdp2.py).

What differs from replicated weights:
- the networks (and the full fine-tune reference copies and the teacher) are parallelized after LoRA, gradient
  checkpointing and the float32 master copy are set up, so FSDP2 shards exactly what is trained and frozen;
- every forward is a collective, so every rank runs the same number of micro-batches: a rank with fewer samples in
  a mini-batch runs zero-weight ones (`_lockstep`);
- gradients are reduced by FSDP2 in the backward; per-head norm weights under tp are summed over tp; the clip
  norm is computed over every shard (`clip_grad_norm`);
- the `old` (EMA) policy and the evaluation EMA are swapped in by value (FSDP2 gathers from its own storage, so a `.data` swap would be
  invisible to it);
- checkpoints: rank 0 writes the usual weight files from gathered tensors (LoRA: only the adapter is gathered),
  and every rank writes its shards of the weights, the EMA copies and the AdamW state to `distcp/`, which loads
  on any world size. A checkpoint of the single-process format loads too (its full tensors are cut into shards).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..distributed.dcp import DCP_DIR, actor_tensors, load_sharded, save_sharded, shard_like
from ..distributed.fsdp2 import clip_grad_norm, parallelize
from .local import EVAL_EMA_FILE, LocalActor, load_copies, set_hyperparameters


class FSDP2Actor(LocalActor):
    def _distribute(self, networks: dict[str, torch.nn.Module]) -> list[torch.nn.Parameter]:
        plans = getattr(type(self.adapter), "parallel_plan", None) or {}
        dtype = getattr(self.adapter, "dtype", torch.float32)
        local_grads = []
        for name, network in networks.items():
            local_grads += self._parallelize(network, plans.get(name), dtype)
        for frozen in (self.reference_models, *self.teachers):
            for name, network in (frozen or {}).items():
                self._parallelize(network, plans.get(name), dtype)
        self._tp_local = [p for m in local_grads for p in m.parameters() if p.requires_grad]
        # the same order as `param_names`: FSDP2 replaces each parameter in place of the old one
        return [p for network in networks.values() for p in network.parameters() if p.requires_grad]

    def _parallelize(self, network: torch.nn.Module, plan: dict | None, dtype: torch.dtype) -> list[torch.nn.Module]:
        """Shard one network in place (actor/veomni.py: through VeOmni instead); returns its tp-local modules."""
        return parallelize(network, plan, self.engine, dtype)

    def _lockstep(self, parts: list[torch.Tensor], shares: list[int]) -> list[torch.Tensor | None]:
        if 0 in self._sizes and any(self._sizes):  # every rank sees the same sizes, so every rank stops here
            raise RuntimeError(f"samples per data-parallel rank after the algorithm's selection: {self._sizes}; "
                               "actor.backend=fsdp2 needs at least one on every rank (each forward is collective)")
        micro = self.cfg.micro_batch_size
        runs = max(max(1, -(-s // (micro or max(s, 1)))) for s in shares)
        parts = [p if len(p) else None for p in parts]
        return parts + [None] * (runs - len(parts))

    def _reduce_and_clip(self) -> torch.Tensor:
        self.engine.sum_over_tp(self._tp_local)
        return clip_grad_norm(self.params, self.cfg.grad_clip)

    @contextmanager
    def _swap_in(self, copies: list[torch.Tensor]):
        self._exchange(copies)
        try:
            yield
        finally:
            self._exchange(copies)

    @torch.no_grad()
    def _exchange(self, copies: list[torch.Tensor]) -> None:
        """Swap the values of the trainable parameters and `copies` (the EMA copy, the evaluation EMA), shard by
        shard. FSDP2 keeps the root module's gathered parameters between forwards, so they are dropped first: the
        next forward gathers the swapped values."""
        from torch.distributed.fsdp import FSDPModule

        for network in self.adapter.modules().values():
            for module in network.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        for p, o in zip(self.params, copies, strict=True):
            held = p.detach().clone()
            p.copy_(o)
            o.copy_(held)

    # ------------------------------------------------------------------------------------ weights
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """`LocalActor.trainable_state`'s full tensors on rank 0 (on the CPU; {} on the other ranks), gathered one
        tensor at a time: with LoRA only the adapter's tensors. A collective: every rank calls it."""
        from peft.utils import get_peft_model_state_dict
        from torch.distributed.tensor import DTensor

        out = {}
        for name, network in self.adapter.modules().items():
            state = get_peft_model_state_dict(network) if self.lora else network.state_dict()
            for key, value in state.items():
                full = value.full_tensor() if isinstance(value, DTensor) else value
                if self.engine.is_main:
                    out[f"{name}.{key}"] = full.detach().to("cpu").contiguous()
        return out

    def save_weights(self, directory: Path) -> None:
        """Rank 0: the weight files of the single-process format (for `polyrl export` / `sample`); every rank: its
        shards of the trainable state in `distcp/` (what a resumed run loads)."""
        directory = Path(directory)
        state = self.trainable_state()
        if self.engine.is_main:
            self._write_weights(directory, state, None, sharded=DCP_DIR)
        (directory / DCP_DIR).mkdir(parents=True, exist_ok=True)
        save_sharded(directory / DCP_DIR, actor_tensors(self))

    def load_weights(self, directory: Path) -> None:
        directory = Path(directory)
        meta = json.loads((directory / "weights.json").read_text())
        if bool(meta["lora"]) != self.lora or meta.get("networks", list(self.adapter.modules())) != list(self.adapter.modules()):
            raise ValueError(f"{directory} holds {'LoRA' if meta['lora'] else 'full'} weights of {meta.get('networks')}; "
                             f"this run trains {'LoRA' if self.lora else 'full'} weights of {list(self.adapter.modules())}")
        if (directory / DCP_DIR).is_dir():
            state = actor_tensors(self)
            state.pop("optimizer")  # loaded with the trainer state (`load_optimizer_state`)
            load_sharded(directory / DCP_DIR, state)
        else:
            self._load_full(directory)
        self.num_updates, self.optimizer_steps = int(meta.get("updates", 0)), int(meta.get("optimizer_steps", 0))

    @torch.no_grad()
    def _load_full(self, directory: Path) -> None:
        """A single-process checkpoint's full tensors, each cut into this rank's shard."""
        if self.lora:
            full = load_file(str(directory / "adapter_model.safetensors"))
            keys = [_peft_key(n) for n in self.param_names]  # the file drops peft's adapter name
        else:
            full = {}
            for name in self.adapter.modules():
                full.update({f"{name}.{k}": v for k, v in load_file(str(directory / f"{name}.safetensors")).items()})
            keys = self.param_names
        missing = [k for k in keys if k not in full]
        if missing:
            raise ValueError(f"{directory}: no tensor for {missing[:3]}")
        for key, p in zip(keys, self.params, strict=True):
            p.copy_(shard_like(full[key], p))
        if self.old_params is not None:
            path = directory / "old_weights.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{directory} has no old_weights.safetensors (the EMA copy this run needs)")
            old = load_file(str(path))
            for name, o in zip(self.param_names, self.old_params, strict=True):
                o.copy_(shard_like(old[name], o))
        if self.eval_params is not None:
            load_copies(directory, EVAL_EMA_FILE, self.param_names, self.eval_params,
                        "the evaluation EMA (actor.eval_ema_decay > 0)", shard_like)

    def optimizer_state(self) -> dict:
        """The settings only: the AdamW tensors are in distcp/ (`save_weights`)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"sharded": DCP_DIR, "param_groups": groups}

    def load_optimizer_state(self, directory: Path, saved: dict) -> None:
        if "sharded" in saved:
            super().load_optimizer_state(directory, saved)
            return
        # the single-process optimizer.state_dict(): per parameter index, full tensors
        from ..distributed.dcp import adam_state

        if len(saved["state"]) and max(saved["state"]) >= len(self.params):
            raise ValueError(f"the saved optimizer has state for {max(saved['state']) + 1} tensors, this run trains "
                             f"{len(self.params)}")
        states = adam_state(self.optimizer, self.param_names, self.params)
        with torch.no_grad():
            for i, name in enumerate(self.param_names):
                for key, value in saved["state"].get(i, {}).items():
                    target = states[name][key]
                    target.copy_(shard_like(value, target) if value.dim() else value.to(target))
        set_hyperparameters(self.optimizer, saved["param_groups"])


def _peft_key(name: str) -> str:
    """`transformer.…to_q.lora_A.default.weight` -> `transformer.…to_q.lora_A.weight` (peft's saved layout)."""
    return name.replace(".default.", ".")
