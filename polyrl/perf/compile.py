"""torch.compile for the denoiser: the whole module, or each repeated transformer block (regional compilation).

Regional compilation compiles one graph per distinct block structure (parameters are graph inputs), so a
24-layer MM-DiT compiles three graphs per mode instead of one 24-layer graph: minutes less warm-up for about
the same step time (docs/performance.md has the measurements).
"""

from __future__ import annotations

import torch


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the module's own ModuleLists of ≥ 2 entries (the transformer layers, not their insides)."""
    return [block for m in module.children() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 for block in m]


def compile_transformer(module: torch.nn.Module, mode: str) -> None:
    if mode == "none":
        return
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if mode == "full":
        module.compile()
        return
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(f"model.compile=blocks: {type(module).__name__} has no repeated blocks; use model.compile=full")
    for block in blocks:
        block.compile()
