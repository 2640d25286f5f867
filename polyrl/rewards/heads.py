"""Small MLP heads stored as safetensors, shared by the learned scorers (aesthetic, latent; the
ranknet heads of hpsv3 and edit_reward come from a checkpoint's state dict).

A head file holds the Linear layers of an `nn.Sequential` under `<prefix><i>.weight` / `<prefix><i>.bias`
(the layout `torch.save(sequential.state_dict())` gives; indices need not be contiguous, so the Dropout /
activation slots of the original Sequential are simply absent). The layers are applied in index order with
`activation` between them (not after the last); Dropout is the identity at inference, so dropping it is exact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

ACTIVATIONS = {"none": nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU}


class MLPHead(nn.Module):
    def __init__(self, layers: list[nn.Linear], activation: str = "none"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not valid; allowed: {', '.join(ACTIVATIONS)}")
        self.layers = nn.ModuleList(layers)
        self.act = ACTIVATIONS[activation]()

    @property
    def in_features(self) -> int:
        return self.layers[0].in_features

    @property
    def out_features(self) -> int:
        return self.layers[-1].out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = self.act(x)
        return x


def load_mlp_head(path: str | Path, prefix: str = "layers.", activation: str = "none") -> MLPHead:
    """An `MLPHead` from a safetensors file (see the module docstring); clear errors for a wrong file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MLP head file {str(path)!r} not found")
    return head_from_state(load_file(str(path)), prefix, activation, str(path))


def head_from_state(state: dict[str, torch.Tensor], prefix: str, activation: str, where: str) -> MLPHead:
    """An `MLPHead` (float32, eval) from the `<prefix><i>.weight` / `.bias` tensors of a state dict (the module
    docstring's layout); `where` names the file in errors."""
    indices = sorted({int(k[len(prefix):].split(".")[0]) for k in state
                      if k.startswith(prefix) and k.endswith(".weight") and k[len(prefix):].split(".")[0].isdigit()})
    if not indices:
        raise ValueError(f"{where}: no '{prefix}<i>.weight' tensors (keys: {', '.join(sorted(state)[:8])})")
    layers = []
    for i in indices:
        w = state[f"{prefix}{i}.weight"]
        b = state.get(f"{prefix}{i}.bias")
        if w.ndim != 2 or (layers and layers[-1].out_features != w.shape[1]):
            raise ValueError(f"{where}: {prefix}{i}.weight has shape {tuple(w.shape)}, which does not follow the "
                             "previous layer")
        layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        with torch.no_grad():
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b)
        layers.append(layer)
    return MLPHead(layers, activation).eval()


def save_mlp_head(head: nn.Sequential | MLPHead, path: str | Path, prefix: str = "layers.") -> Path:
    """Write the Linear layers of `head` in the format `load_mlp_head` reads (for tests and conversions)."""
    from safetensors.torch import save_file

    mods = head.layers if isinstance(head, MLPHead) else head
    state = {}
    for i, m in enumerate(mods):
        if isinstance(m, nn.Linear):
            state[f"{prefix}{i}.weight"] = m.weight.detach().contiguous()
            if m.bias is not None:
                state[f"{prefix}{i}.bias"] = m.bias.detach().contiguous()
    save_file(state, str(path))
    return Path(path)
