"""Linear layers that read the same input, with a PEFT LoRA on each: their LoRA A matrices run as one matmul.

A LoRA linear computes base(x) + B(A(x)) * scaling. An attention layer's q, k and v projections read the same x, so
their A matrices (r rows each) concatenate into one (3r, d) matrix: x is read once instead of three times, and in
the backward the gradient of x is one matmul instead of three and two additions. The math is PEFT's vanilla LoRA
forward; any other state (adapters disabled or merged, dropout, several active adapters, a LoRA variant such as
DoRA, a layer without LoRA) runs each layer's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _vanilla_adapter(layers: list[torch.nn.Module]) -> str | None:
    """The one active adapter of every layer, if each runs PEFT's vanilla LoRA forward with it (else None)."""
    name = None
    for layer in layers:
        active = getattr(layer, "active_adapters", None)
        if (not hasattr(layer, "lora_A") or getattr(layer, "disable_adapters", True) or getattr(layer, "merged", True)
                or active is None or len(active) != 1 or (name is not None and active[0] != name)):
            return None
        name = active[0]
        if (name not in layer.lora_A or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
                or name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False)
                or layer.lora_A[name].bias is not None):
            return None
    casts = {getattr(layer, "cast_input_dtype_enabled", True) for layer in layers}
    dtypes = {layer.lora_A[name].weight.dtype for layer in layers}
    return name if len(casts) == 1 and len(dtypes) == 1 else None


def shared_input_projections(layers: list[torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[layer(x) for layer in layers], with the LoRA A matrices of the layers concatenated into one matmul."""
    name = _vanilla_adapter(layers)
    if name is None or len(layers) < 2:
        return [layer(x) for layer in layers]
    a_weights = [layer.lora_A[name].weight for layer in layers]
    a = torch.cat(a_weights)  # (sum of ranks, d)
    # PEFT casts the input to the A matrix's dtype (the float32 master weights; autocast then picks the matmul's)
    hidden = F.linear(x.to(a.dtype) if getattr(layers[0], "cast_input_dtype_enabled", True) else x, a)
    outputs = []
    for layer, part in zip(layers, hidden.split([w.shape[0] for w in a_weights], dim=-1), strict=True):
        base = layer.base_layer(x)
        outputs.append((base + layer.lora_B[name](part) * layer.scaling[name]).to(base.dtype))
    return outputs
