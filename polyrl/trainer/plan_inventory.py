"""What a checkpoint holds, from its safetensors headers alone (nothing loaded): the memory plan's input
(trainer/memory_plan.py). Also the LoRA parameter count on target modules and the repeated blocks' count and width."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Tensor:
    shape: tuple[int, ...]
    nbytes_stored: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Network:
    """One component of a checkpoint: its tensors (name -> shape, stored bytes) and its config.json."""

    name: str
    tensors: dict[str, Tensor]
    config: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())


def safetensors_header(path: Path) -> dict[str, Tensor]:
    """The tensors a .safetensors file holds, from its header alone (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: Tensor(tuple(v["shape"]), v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


def read_inventory(path: str | Path) -> dict[str, Network]:
    """Every component of a checkpoint directory that holds weights: its subfolders with *.safetensors (diffusers),
    or the directory itself (transformers: one component, `model`)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model.path={str(root)!r} is not a directory")
    out = {}
    for folder, name in [(root, "model")] + [(p, p.name) for p in sorted(root.iterdir()) if p.is_dir()]:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            continue
        tensors = {}
        for f in files:
            tensors.update(safetensors_header(f))
        config = folder / "config.json"
        out[name] = Network(name, tensors, json.loads(config.read_text()) if config.is_file() else {})
    if not out:
        raise FileNotFoundError(f"model.path={str(root)!r} holds no *.safetensors weights (the plan reads their "
                                "headers)")
    return out


def inventory_from_modules(modules: dict) -> dict[str, Network]:
    """The inventory of modules in memory (any device, `meta` too): what `save_pretrained` would write."""
    out = {}
    for name, module in modules.items():
        state = getattr(module, "state_dict", None)
        if state is None:
            continue
        tensors = {k: Tensor(tuple(v.shape), v.numel() * v.element_size()) for k, v in module.state_dict().items()}
        if tensors:
            config = getattr(module, "config", {})
            config = dict(config) if isinstance(config, dict) else config.to_dict()
            out[name] = Network(name, tensors, config)
    return out


def trained_names(inventory: dict[str, Network], family: str) -> list[str]:
    """The networks a run trains: a diffusers checkpoint's transformer(s), else the one model."""
    names = [n for n in inventory if n.startswith("transformer")]
    return names or ([n for n in inventory if n == "model"] or list(inventory)[:1])


def matches(module: str, targets: list[str]) -> bool:
    """peft's rule for a list of target names: the module's name, or its last dotted parts."""
    return any(module == t or module.endswith("." + t) for t in targets)


def lora_parameters(network: Network, targets: list[str], rank: int) -> int:
    """r·(in + out) for every 2-D `<module>.weight` whose module a target names (peft's LoRA A and B)."""
    total = 0
    for key, t in network.tensors.items():
        if key.endswith(".weight") and len(t.shape) == 2 and matches(key[: -len(".weight")], targets):
            total += rank * (t.shape[0] + t.shape[1])
    return total


BLOCK = re.compile(r"^(.*?)\.(\d+)\.")


def blocks(network: Network) -> tuple[int, int]:
    """(repeated blocks, their width): every ModuleList of blocks (`<list>.<i>.`) that holds over a tenth of the
    parameters, and the most common input width of their 2-D weights."""
    lists: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    widths: dict[int, int] = {}
    for key, t in network.tensors.items():
        m = BLOCK.match(key)
        if not m:
            continue
        lists.setdefault(m.group(1), set()).add(int(m.group(2)))
        size[m.group(1)] = size.get(m.group(1), 0) + t.numel
    total = max(network.numel, 1)
    big = [name for name in lists if size[name] > total / 10]
    for key, t in network.tensors.items():
        m = BLOCK.match(key)
        if m and m.group(1) in big and len(t.shape) == 2 and key.endswith(".weight"):
            widths[t.shape[1]] = widths.get(t.shape[1], 0) + 1
    n = sum(len(lists[name]) for name in big)
    return n, (max(widths, key=widths.get) if widths else 0)
