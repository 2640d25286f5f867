"""Tensor parallel (DTensor) of a network's blocks by its plan (distributed/plan.py), with or without LoRA.

Megatron layout per block: the q/k/v projections and the MLP's first linear are split column-wise (each rank
computes whole heads / a slice of the hidden units from the replicated input), the attention output projection and
the MLP's second linear row-wise (each rank's partial product, summed over tp). Between the two each rank works on
its own heads, so the attention modules' `heads` attribute becomes the local count.

A peft LoRA layer wraps its base linear: column-wise, the base and `lora_B` are split by columns and `lora_A` stays
replicated (its r outputs are needed whole); row-wise, the base and `lora_A` are split by rows (their partial
products are summed) and `lora_B` stays replicated.

Replicated parameters that act on one rank's heads (the per-head q/k RMS norms) get a gradient from the local
heads only: `apply_tensor_parallel` returns their modules, and the actor sums their gradients over tp after each
backward (without that sum a tp2 run's weights differ from the 1-process run's by 5e-4 after 2 steps).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _lora_parts(module: torch.nn.Module) -> tuple[torch.nn.Module, list, list] | None:
    """(base linear, lora_A linears, lora_B linears) of a peft LoRA layer; None for a plain linear."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return None
    return base, list(module.lora_A.values()), list(module.lora_B.values())


def apply_tensor_parallel(network: torch.nn.Module, plan: dict, tp_mesh) -> list[torch.nn.Module]:
    """Split the plan's linears of every block over `tp_mesh` (in place); returns the modules whose trainable
    parameters' gradients must be summed over tp (see the module docstring; read their parameters after FSDP2
    has replaced them)."""
    tensor, tp = plan["tensor"], tp_mesh.size()
    local_grads: list[torch.nn.Module] = []
    for block in getattr(network, plan["blocks"]):
        for style, names in ((ColwiseParallel, tensor["colwise"]), (RowwiseParallel, tensor["rowwise"])):
            for name in names:
                module = _find(block, name)
                if module is None:
                    continue
                parts = _lora_parts(module)
                if parts is None:
                    parallelize_module(module, tp_mesh, style())
                    continue
                base, lora_a, lora_b = parts
                parallelize_module(base, tp_mesh, style())
                for sub in (lora_b if style is ColwiseParallel else lora_a):
                    parallelize_module(sub, tp_mesh, style())
        for name in tensor.get("heads", []):
            attention = _find(block, name)
            if attention is not None:
                if attention.heads % tp:
                    raise ValueError(f"{name}: {attention.heads} heads cannot be split over tp={tp} ranks")
                attention.heads //= tp
        for name in tensor.get("local_grads", []):
            module = _find(block, name)
            if module is not None:
                local_grads.append(module)
    return local_grads


def _find(block: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        module = block.get_submodule(name)
    except AttributeError:
        return None
    return module
