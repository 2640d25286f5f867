"""The executed-FLOP counter that each model's analytic FLOP count is checked against (tests/test_flops.py,
test_wan.py, test_flux.py, ...): 2·(output elements)·(fan-in) for every Linear / convolution call, counted by forward
hooks, and 4·B·Sq·Sk·(H·D) for every attention call, counted by patching the attention entry point the model calls.

Attention takes B, Sq, H and D from the query and Sk from the key, so cross-attention counts Sq·Sk, a mask counts
nothing (masked positions are computed), and grouped-query attention counts the query's heads. The entry point is
pluggable: `SDPA` (torch.nn.functional.scaled_dot_product_attention, (B, H, S, D)) or `dispatch_attention(module)`
(diffusers' dispatch_attention_fn as a transformer module imported it, (B, S, H, D)); either may be called with
query / key positionally or as query= / key=."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd


@dataclass(frozen=True)
class AttentionEntry:
    """`getattr(owner, name)` is the function every attention call of the model goes through; `layout` is its
    tensors' dimension order, "BHSD" or "BSHD"."""

    owner: object
    name: str
    layout: str

    def __post_init__(self):
        assert self.layout in ("BHSD", "BSHD"), self.layout


SDPA = AttentionEntry(torch.nn.functional, "scaled_dot_product_attention", "BHSD")


def dispatch_attention(module: ModuleType) -> AttentionEntry:
    """diffusers' dispatch_attention_fn as looked up by a transformer module, e.g. transformer_flux: (B, S, H, D)."""
    return AttentionEntry(module, "dispatch_attention_fn", "BSHD")


@dataclass
class Executed:
    flops: float = 0.0
    attention_calls: int = 0


def fan_in(mod: torch.nn.Module) -> int:
    """Products summed into one output element of a Linear or convolution."""
    if isinstance(mod, torch.nn.Linear):
        return mod.in_features
    if isinstance(mod, _ConvTransposeNd):  # with stride = kernel each output element gathers in_channels products
        assert all(k % s == 0 for k, s in zip(mod.kernel_size, mod.stride, strict=True)), mod
        return mod.in_channels // mod.groups * math.prod(mod.kernel_size) // math.prod(mod.stride)
    return mod.in_channels // mod.groups * math.prod(mod.kernel_size)


def attention_flops(layout: str, query: torch.Tensor, key: torch.Tensor) -> float:
    if layout == "BHSD":
        b, h, sq, d = query.shape
        sk = key.shape[2]
    else:
        b, sq, h, d = query.shape
        sk = key.shape[1]
    return 4.0 * b * sq * sk * h * d


@contextmanager
def count_flops(model: torch.nn.Module, attention: AttentionEntry = SDPA) -> Iterator[Executed]:
    """Within the block, add every Linear / convolution call of `model`'s modules and every call of `attention` (the
    model's or anything else's) to the yielded Executed."""
    executed = Executed()

    def on_layer(mod, args, out):
        executed.flops += 2.0 * out.numel() * fan_in(mod)

    original = getattr(attention.owner, attention.name)

    def counting_attention(*args, **kwargs):
        query = args[0] if len(args) > 0 else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        executed.flops += attention_flops(attention.layout, query, key)
        executed.attention_calls += 1
        return original(*args, **kwargs)

    handles = [m.register_forward_hook(on_layer) for m in model.modules() if isinstance(m, torch.nn.Linear | _ConvNd)]
    setattr(attention.owner, attention.name, counting_attention)
    try:
        yield executed
    finally:
        setattr(attention.owner, attention.name, original)
        for h in handles:
            h.remove()


def executed_flops(model: torch.nn.Module, inputs: dict, attention: AttentionEntry = SDPA) -> tuple[float, int]:
    """(FLOPs, attention calls) of one `model(**inputs)` without gradients."""
    with count_flops(model, attention) as executed, torch.no_grad():
        model(**inputs)
    return executed.flops, executed.attention_calls
