"""torch.compile for the denoiser: the whole module, or each repeated transformer block (regional compilation).

Regional compilation compiles one graph per distinct block structure (parameters are graph inputs), so a
24-layer MM-DiT compiles three graphs per mode instead of one 24-layer graph: minutes less warm-up for about
the same step time (docs/performance.md has the measurements).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CACHE_FILE = "compile_cache.bin"
# torch's own compile timers (seconds, summed over this process): dynamo's frame compiles, which include inductor's
# forward graphs, and AOTAutograd's lazy backward compiles, which run at a graph's first backward
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds this process has spent compiling (COMPILE_TIMERS) so far; kernel autotuning at a kernel's first run
    is not in them. 0.0 where torch keeps no such timers."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return float(sum(sum(metrics.get(name, ())) for name in COMPILE_TIMERS))


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


def compile_cache_path(setting: str | None, run_dir: Path) -> Path | None:
    """`model.compile_cache`: `auto` is the run directory's compile_cache.bin (a resumed run finds it), a path is that
    file (share one across runs of a recipe on one GPU type and torch version), null turns it off."""
    if setting in (None, "", "none", "null"):
        return None
    return run_dir / CACHE_FILE if setting == "auto" else Path(setting)


def load_compile_cache(path: Path | None) -> int:
    """Pre-fill torch.compile's caches (inductor's compiled graphs and kernels, AOTAutograd's graphs, autotuning
    results) from the artifacts a previous run saved, so that this run's graphs load instead of compiling
    (`torch.compiler.load_cache_artifacts`; docs/performance.md: SD3.5-M's first epoch 41 s warm against 112 s cold).
    Call before the first compiled call. Returns the artifact bytes loaded (0: no file); unreadable artifacts are a
    ValueError (compiling from scratch is the caller's fallback)."""
    if path is None or not path.is_file():
        return 0
    data = path.read_bytes()
    if torch.compiler.load_cache_artifacts(data) is None:
        raise ValueError(f"{path}: torch cannot read these compile-cache artifacts (corrupt, or written by another "
                         "torch version)")
    return len(data)


def save_compile_cache(path: Path | None) -> int:
    """Write what this process compiled (`torch.compiler.save_cache_artifacts`) to `path`, atomically, unless the
    file already holds more (a run that only loaded its graphs has less to write). Returns the bytes written."""
    if path is None:
        return 0
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    if not data or (path.is_file() and path.stat().st_size >= len(data)):
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:  # e.g. a full disk: no partial file left behind
        tmp.unlink(missing_ok=True)
        raise
    return len(data)
