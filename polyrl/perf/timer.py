"""Stage timings that mean what they say on a GPU: the device is synchronised at each stage boundary."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .profile import region


class StageTimer:
    """`with timer("rollout"): ...` adds the stage's wall seconds to `timer.times["time/rollout"]`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            with region(name):
                yield
        except BaseException as e:  # the innermost stage a failure happened in, for its message (trainer/oom.py)
            if not hasattr(e, "polyrl_stage"):
                try:
                    e.polyrl_stage = name
                except AttributeError:  # an exception type without attributes of its own: no stage to name
                    pass
            raise
        finally:
            self._sync()
            key = f"time/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0
