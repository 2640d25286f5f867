"""What every policy kind's rollout stage offers the training step (trainer/step.py), and the step's RNG.

A policy kind (models/base.py `policy_kind`: diffusion, tokens, ...) registers one `PolicySampler` class in
`SAMPLERS`; the trainer builds the one of its model's kind and never asks which it is. A new kind is a sampler
class here plus an actor (actor/) and, if it trains on offline pairs, a pair format (data/).

A sampler's randomness comes from `step_generator(seed, step, stream)`: each (step, purpose) has its own generator,
independent of everything before it, so a resumed run draws exactly what an uninterrupted one would, and every
rank draws the whole step's numbers and keeps its own rows (the numbers do not depend on the world size).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from ..batch import Rollout
from ..registry import Registry

# step_generator streams: the rollout's first draws, the update's, a refilled rollout's (dynamic sampling)
ROLLOUT_STREAM, UPDATE_STREAM, REFILL_STREAM = 0, 1, 2


def step_generator(seed: int, step: int, stream: int = ROLLOUT_STREAM) -> torch.Generator:
    """The RNG of one (step, purpose): independent of everything before it, so resume is exact."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 16 + stream)


def repeat_rows(rows: list, n: int, split_row) -> tuple[list, list[dict]]:
    """(prompts, metadata) of `rows`, each row n times in a row (one prompt group)."""
    prompts, metadata = [], []
    for row in rows:
        prompt, meta = split_row(row)
        prompts += [prompt] * n
        metadata += [meta] * n
    return prompts, metadata


class PolicySampler(Protocol):
    """The rollout stage of one policy kind, as the training step and the evaluation use it."""

    fp8_auto: bool  # model.fp8=auto is decided by measurement for this kind (perf/fp8.py), else off
    runs_on_replicas: bool  # has `use_remote(remote, max_staleness)`: Ray rollout replicas (rollout.workers > 0)
    plan: object  # what a rollout samples (SamplingPlan, TokenPlan)
    fps: float  # frames per second of sample videos

    def draws(self, group_ids: torch.Tensor, mine: slice, step: int, attempt: int):
        """Every random number of the step's `attempt`-th rollout (0: the first, then dynamic sampling's refills),
        drawn for the whole step (`group_ids` of every sample, every rank), returned for this rank's `mine`."""
        ...

    def rollout(self, prompts: list, metadata: list[dict], group_ids: torch.Tensor, draws, sink, times: dict) -> Rollout:
        """Sample this rank's samples; every chunk goes to `sink.put(MediaChunk)` as soon as it is sampled."""
        ...

    def prepare_next(self, step: int, num_rows: int) -> None:
        """Start what the next step's rollout needs while this step trains (its draws; a remote prefetch)."""
        ...

    def evaluate(self, prompts: list, metadata: list[dict], seed: int) -> Rollout:
        """Deterministic held-out samples (the same for the same weights): ODE / greedy decoding."""
        ...

    def metrics(self, batches: list[Rollout], engine) -> dict[str, float]:
        """Kind-specific metrics of a step's rollouts (e.g. response lengths)."""
        ...

    def close(self) -> None: ...


SAMPLERS = Registry("sampler")


class DrawAhead:
    """The next step's draws, made on a worker thread while this step trains. A draw is CPU work (the SD3.5-M
    benchmark's 64 samples x 11 latents of 16x64x64 are 46 M normals, ~0.3 s) that the GPU would otherwise wait for
    at the start of every step. Same generator, same numbers as a draw in place; a draw for another key (the step
    after a stop, a changed batch) is discarded and drawn again."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-draws")
        self.pending: tuple[tuple, Future] | None = None

    def start(self, key: tuple, draw) -> None:
        self.discard()
        self.pending = (key, self.pool.submit(draw))

    def take(self, key: tuple, draw):
        """The draws for `key`: the ones made ahead, else `draw()` now."""
        if self.pending is not None and self.pending[0] == key:
            (_, future), self.pending = self.pending, None
            return future.result()
        self.discard()
        return draw()

    def discard(self) -> None:
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None

    def close(self) -> None:
        self.discard()
        self.pool.shutdown(wait=True)
