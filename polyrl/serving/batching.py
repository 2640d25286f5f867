"""Server-side batching: concurrent requests are merged into scorer calls of at most `max_batch` samples.

A request (a batch of images, videos or audio clips) is cut into pieces of at most `max_batch` samples; pieces
of the same kind and shape (image size; video frames and size; audio channels, length and sample rate) are
merged (in arrival order) until the batch is full or `max_wait_s` has passed since the first piece was taken,
then the scorer runs once through `call_reward`, in its own thread, and the scores and per-sample extras are
split back to their requests. The scorer is never called concurrently (it usually owns one model on one
device). An image scorer scoring video gets K frames per video (`reward.frames`), so its call holds up to
`max_batch * K` images.

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

from ..rewards.base import Audio, RewardOutput, call_reward, media_cat, media_kind, media_len, media_slice


class ScorerFailed(RuntimeError):
    """The scorer raised or returned unusable scores; `rejected_input` is True for its ValueErrors."""

    def __init__(self, message: str, rejected_input: bool = False):
        super().__init__(message)
        self.rejected_input = rejected_input


def media_key(media) -> tuple:
    """What two batches must share to be scored in one call: kind and per-sample shape (and sample rate)."""
    if isinstance(media, Audio):
        return ("audio", tuple(media.waveform.shape[1:]), media.sample_rate)
    return (media_kind(media), tuple(media.shape[1:]))


@dataclass(eq=False)  # compared by identity (a field-wise == would compare the media tensors)
class _Job:
    media: torch.Tensor | Audio  # images (n, 3, H, W), video (n, T, 3, H, W) or Audio
    prompts: list[str]
    metadata: list[dict]
    future: asyncio.Future
    scores: list[float | None] = field(default_factory=list)
    extras: dict[str, list] = field(default_factory=dict)
    remaining: int = 0  # pieces not yet scored
    key: tuple = ()  # media_key(media): only pieces of one key are merged


@dataclass(eq=False)
class _Piece:
    job: _Job
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> tuple:
        return self.job.key


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
        raise ScorerFailed(f"scorer returned {scores.numel()} scores for {n} samples")
    bad = int((~torch.isfinite(scores)).sum())
    if bad:
        raise ScorerFailed(f"scorer returned {bad} non-finite scores of {n}")
    return scores.tolist()


class BatchingScorer:
    """`await score(media, prompts, metadata)` from any number of concurrent requests."""

    def __init__(self, reward, max_batch: int = 64, max_wait_s: float = 0.005):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.reward, self.max_batch, self.max_wait_s = reward, max_batch, max_wait_s
        self._pieces: deque[_Piece] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-scorer")
        self._worker: asyncio.Task | None = None
        # "images": the samples scored (images, videos or audio clips)
        self.stats = {"requests": 0, "images": 0, "scorer_calls": 0, "scorer_errors": 0}

    async def score(self, media, prompts: list[str], metadata: list[dict]) -> tuple[list, dict, dict]:
        """(scores, per-sample extras, other extras) for one request."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())
        n = media_len(media)
        job = _Job(media, prompts, metadata, asyncio.get_running_loop().create_future(), [None] * n,
                   key=media_key(media))
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
            fits = [p for p in self._pieces if p.key == batch[0].key and p.size + size <= self.max_batch]
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
        media = media_cat([media_slice(p.job.media, p.start, p.stop) for p in batch])
        prompts = [x for p in batch for x in p.job.prompts[p.start : p.stop]]
        metadata = [x for p in batch for x in p.job.metadata[p.start : p.stop]]
        self.stats["scorer_calls"] += 1
        try:
            out = await loop.run_in_executor(self._executor, call_reward, self.reward, media, prompts, metadata)
        except ValueError as e:
            raise ScorerFailed(f"the scorer rejected the input: {type(e).__name__}: {e}", rejected_input=True) from e
        except Exception as e:
            raise ScorerFailed(f"the scorer raised {type(e).__name__}: {e}") from e
        n = len(prompts)
        try:
            scores = checked_scores(out, n)
            per_sample, other = per_sample_extras(out.extras, n)
        except ScorerFailed:
            raise
        except Exception as e:  # e.g. not a RewardOutput: an error for the request, never a dead worker
            raise ScorerFailed(f"the scorer returned an unusable answer ({type(e).__name__}: {e})") from e
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
