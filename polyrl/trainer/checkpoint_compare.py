"""Bit-for-bit comparison of two checkpoints: what `trainer.deterministic=true` promises for two runs of the same
config on the same machine (docs/algorithms.md "Deterministic runs"). Weights are every `*.safetensors` file of the
directories (LoRA adapter or full networks, the EMA / old copy); the optimizer is `trainer_state.pt`'s AdamW state
(moments and step counts) and its hyperparameters."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .checkpoint import STATE_FILE


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """Equal to the bit: same dtype, shape and bytes (NaNs compare equal to themselves here)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    return a == b


def _walk(prefix: str, a, b, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{prefix}{k} (in one only)")
            else:
                _walk(f"{prefix}{k}.", a[k], b[k], out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(f"{prefix}{i}.", x, y, out)
    elif not _same(a, b):
        out.append(prefix.rstrip("."))


def checkpoint_differences(a: str | Path, b: str | Path) -> list[str]:
    """The names of the weights and optimizer-state entries that differ between checkpoints `a` and `b` (empty:
    bit-identical). Weight entries are `<file>:<tensor>`, optimizer ones `optimizer.<path>`."""
    a, b = Path(a), Path(b)
    out: list[str] = []
    files = sorted({p.name for p in a.glob("*.safetensors")} | {p.name for p in b.glob("*.safetensors")})
    if not files:
        out.append("no *.safetensors weights in either checkpoint")
    for name in files:
        if not (a / name).is_file() or not (b / name).is_file():
            out.append(f"{name} (in one only)")
            continue
        _walk(f"{name}:", load_file(str(a / name)), load_file(str(b / name)), out)
    sa = torch.load(a / STATE_FILE, map_location="cpu", weights_only=True)
    sb = torch.load(b / STATE_FILE, map_location="cpu", weights_only=True)
    _walk("optimizer.", sa.get("optimizer"), sb.get("optimizer"), out)
    return out
