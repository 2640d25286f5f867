"""Copies from the GPU to the host that do not make the host wait.

A copy into pageable memory blocks the host until the device has run everything queued before it; a copy into
page-locked (pinned) memory is only queued. The host may then read the copy once an event recorded after it on the
same stream has completed (`torch.cuda.Event.synchronize`); the callers hold such an event.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


def host_copy(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A copy of `tensor` on the host; `pinned` (a CUDA tensor): into pinned memory, only queued."""
    if not pinned:
        return tensor.to("cpu", copy=True)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def to_host(value, pinned: bool):
    """`host_copy` of every tensor in `value` (a tensor, or dicts and tuples of them)."""
    return tree_map(lambda t: host_copy(t, pinned), value)
