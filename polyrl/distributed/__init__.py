"""Scale-out: the engine seam (engine.py: one process, data parallel; fsdp2.py, veomni.py: sharded weights with
sequence and tensor parallel ranks), parallel layouts, DCP checkpoints, Ray worker groups and weight sync."""

from .dims import SHARDED_BACKENDS, ParallelDims
from .engine import DataParallelEngine, LocalEngine, pick_device


def build_engine(device_name: str, cfg=None) -> LocalEngine:
    """`actor.backend=fsdp2`: an `FSDP2Engine` (also at world size 1) on the layout of `cfg.parallel`
    (`actor.backend=veomni`: a `VeOmniEngine`, its meshes from VeOmni's parallel state); else a
    `DataParallelEngine` under a multi-process launch (WORLD_SIZE > 1), else one process on `device_name`."""
    if cfg is not None and cfg.actor.backend in SHARDED_BACKENDS:
        from ..models import MODELS
        from .plan import check_parallel_config

        dims = check_parallel_config(cfg, MODELS.get(cfg.model.name))
        if cfg.actor.backend == "veomni":  # config validation has checked that VeOmni imports (require_veomni)
            from .veomni import VeOmniEngine

            return VeOmniEngine(device_name, dims)
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(device_name, dims)
    if ParallelDims.from_env().world_size > 1:
        return DataParallelEngine(device_name)
    return LocalEngine(pick_device(device_name))


__all__ = ["DataParallelEngine", "LocalEngine", "ParallelDims", "build_engine", "pick_device"]
