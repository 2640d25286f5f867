from .dims import ParallelDims
from .engine import DataParallelEngine, LocalEngine, build_engine, pick_device

__all__ = ["DataParallelEngine", "LocalEngine", "ParallelDims", "build_engine", "pick_device"]
