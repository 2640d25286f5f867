"""Device memory facts a run reports: whether an exception is an out-of-memory, the sizes its message names, and
the device's free memory. The memory plan (trainer/memory_plan.py) turns them into one `polyrl: error:` line."""

from __future__ import annotations

import gc
import re

import torch

GIB = 2**30
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch's caching allocator: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB
# of which 1.50 GiB is free. ..."
_ASKED = re.compile(r"Tried to allocate ([\d.]+) (B|bytes|KiB|MiB|GiB|TiB)")
_FREE = re.compile(r"of which ([\d.]+) (B|bytes|KiB|MiB|GiB|TiB) is free")
# what other layers say when an allocation fails inside them (cuBLAS / cuDNN workspaces, NCCL, a raw cudaMalloc)
_OTHER = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
          "CUDNN_STATUS_ALLOC_FAILED", "HIP out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory (torch.OutOfMemoryError, or a library's own words)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _OTHER)


def _size(pattern: re.Pattern, text: str) -> float | None:
    m = pattern.search(text)
    return None if m is None else float(m.group(1)) * _UNITS[m.group(2)] / GIB


def oom_sizes(message: str) -> tuple[float | None, float | None]:
    """(GiB the failed allocation asked for, GiB the device had free) as the allocator's message names them."""
    return _size(_ASKED, message), _size(_FREE, message)


def free_memory_gib(device: torch.device | None = None) -> tuple[float, float] | None:
    """(free, total) GiB of a CUDA device as the driver reports them (other processes' use included); None off CUDA."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free / GIB, total / GIB


def release_cached_memory() -> None:
    """After an out-of-memory: collect what the failed stage left (its frames, once the traceback is dropped) and
    give the allocator's cached blocks back, so that saving the last step has room (CUDA only)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
