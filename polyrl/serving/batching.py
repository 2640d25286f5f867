"""Server-side batching: concurrent requests are merged into scorer calls of at most `max_batch` images.

A request is cut into pieces of at most `max_batch` images; pieces of equal image size are merged (in arrival
order) until the batch is full or `max_wait_s` has passed since the first piece was taken, then the scorer runs
once, in its own thread, and the scores and per-sample extras are split back to their requests. The scorer is
never called concurrently (it usually owns one model on one device).

If a merged call raises, each of its requests is scored again alone, so an error is reported to the request
that caused it and the others still get their scores.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..rewards.base import RewardOutput


class ScorerFailed(RuntimeError):
    """The scorer raised or returned unusable scores; `rejected_input` is True for its ValueErrors."""

    def __init__(self, message: str, rejected_input: bool = False):
        super().__init__(message)
        self.rejected_input = rejected_input


@dataclass
class _Job:
    images: torch.Tensor  # (n, 3, H, W)
    prompts: list[str]
    metadata: list[dict]
    future: asyncio.Future
    scores: list[float | None] = field(default_factory=list)
    extras: dict[str, list] = field(default_factory=dict)
    remaining: int = 0  # pieces not yet scored


@dataclass
class _Piece:
    job: _Job
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.job.images.shape[1:])


def _plain(value):
    """JSON-safe scalar: tensors/numpy to Python numbers, NaN/inf to None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def per_sample_extras(extras: dict, n: int) -> tuple[dict[str, list], dict]:
    """Split `extras` into per-sample lists (length n) and the rest (returned whole to every request)."""
    per_sample, other = {}, {}
    for k, v in extras.items():
        if isinstance(v, torch.Tensor):
            v = v.tolist() if v.ndim > 0 else v.item()
        if isinstance(v, (list, tuple)) and len(v) == n:
            per_sample[k] = [_plain(x) for x in v]
        else:
            other[k] = _plain(v)
    return per_sample, other


def checked_scores(out: RewardOutput, n: int) -> list[float]:
    scores = torch.as_tensor(out.scores, dtype=torch.float32).reshape(-1)
    if scores.numel() != n:
        raise ScorerFailed(f"scorer returned {scores.numel()} scores for {n} images")
    bad = int((~torch.isfinite(scores)).sum())
    if bad:
        raise ScorerFailed(f"scorer returned {bad} non-finite scores of {n}")
    return scores.tolist()


class BatchingScorer:
    """`await score(images, prompts, metadata)` from any number of concurrent requests."""

    def __init__(self, reward, max_batch: int = 64, max_wait_s: float = 0.005):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.reward, self.max_batch, self.max_wait_s = reward, max_batch, max_wait_s
        self._pieces: deque[_Piece] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-scorer")
        self._worker: asyncio.Task | None = None
        self.stats = {"requests": 0, "images": 0, "scorer_calls": 0, "scorer_errors": 0}

    async def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> tuple[list, dict, dict]:
        """(scores, per-sample extras, other extras) for one request."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())
        n = images.shape[0]
        job = _Job(images, prompts, metadata, asyncio.get_running_loop().create_future(), [None] * n)
        for start in range(0, n, self.max_batch):
            self._pieces.append(_Piece(job, start, min(n, start + self.max_batch)))
            job.remaining += 1
        self.stats["requests"] += 1
        self._arrived.set()
        return await job.future

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ worker
    async def _take_batch(self) -> list[_Piece]:
        while not self._pieces:
            self._arrived.clear()
            await self._arrived.wait()
        batch = [self._pieces.popleft()]
        deadline = time.monotonic() + self.max_wait_s
        while True:
            size = sum(p.size for p in batch)
            fits = [p for p in self._pieces if p.image_shape == batch[0].image_shape and p.size + size <= self.max_batch]
            if fits:
                self._pieces.remove(fits[0])
                batch.append(fits[0])
                continue
            left = deadline - time.monotonic()
            if left <= 0 or size >= self.max_batch:
                return batch
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._take_batch()
            batch = [p for p in batch if not p.job.future.done()]  # a failed request's other pieces are dropped
            if not batch:
                continue
            try:
                await self._score_pieces(loop, batch)
            except ScorerFailed as e:
                if len({id(p.job) for p in batch}) == 1:
                    self._fail(batch[0].job, e)
                    continue
                for p in batch:  # find the request that broke the merged call
                    if p.job.future.done():
                        continue
                    try:
                        await self._score_pieces(loop, [p])
                    except ScorerFailed as e1:
                        self._fail(p.job, e1)

    def _fail(self, job: _Job, error: ScorerFailed) -> None:
        self.stats["scorer_errors"] += 1
        if not job.future.done():
            job.future.set_exception(error)

    async def _score_pieces(self, loop, batch: list[_Piece]) -> None:
        images = torch.cat([p.job.images[p.start : p.stop] for p in batch])
        prompts = [x for p in batch for x in p.job.prompts[p.start : p.stop]]
        metadata = [x for p in batch for x in p.job.metadata[p.start : p.stop]]
        self.stats["scorer_calls"] += 1
        try:
            out = await loop.run_in_executor(self._executor, self.reward, images, prompts, metadata)
        except ValueError as e:
            raise ScorerFailed(f"the scorer rejected the input: {type(e).__name__}: {e}", rejected_input=True) from e
        except Exception as e:
            raise ScorerFailed(f"the scorer raised {type(e).__name__}: {e}") from e
        n = images.shape[0]
        scores = checked_scores(out, n)
        per_sample, other = per_sample_extras(out.extras, n)
        offset = 0
        for p in batch:
            job = p.job
            job.scores[p.start : p.stop] = scores[offset : offset + p.size]
            for k, v in per_sample.items():
                job.extras.setdefault(k, [None] * len(job.prompts))[p.start : p.stop] = v[offset : offset + p.size]
            offset += p.size
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                self.stats["images"] += len(job.prompts)
                job.future.set_result((job.scores, job.extras, other))
