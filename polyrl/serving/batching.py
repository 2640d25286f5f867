"""Server-side batching: concurrent requests are merged into scorer calls of bounded size, small ones first.

A request (a batch of images, videos or audio clips) is cut into pieces of at most `max_batch` samples and
`max_call_pixels` pixels (one sample when a single one is larger). A scorer call is formed around a piece of the
request that has been served least so far (fewest pixels scored; ties in arrival order: least attained service),
then filled with more pieces of the same kind and shape (image size; video frames and size; audio channels,
length and sample rate), least-served requests first, until it is full or `max_wait_s` has passed since it was
started. So a small request that arrives while a large one is being scored waits for one scorer call, not for
the whole large request. The scorer then runs once through `call_reward`, in its own thread, and the scores and
per-sample extras are split back to their requests. The scorer is never called concurrently (it usually owns
one model on one device). An image scorer scoring video gets K frames per video (`reward.frames`), so its call
holds up to `max_batch * K` images.

Images and video wait as uint8 (what the server decoded); a call's share is turned into float32 in [0, 1] in
the scorer's thread just before the scorer runs, so at most one call's float copy exists at a time.

A request with `groups` (a group reward's: each group's members contiguous) is cut only between groups (a group
larger than a call is a piece of its own), and a call's group ids are made distinct across its requests, so a
group reward gets every member of each group in the call and no sample of another request's group as its own.

If a merged call raises, each of its requests is scored again alone, so an error is reported to the request
that caused it and the others still get their scores.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
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
    if isinstance(media, list):  # texts: any lengths score together
        return ("text",)
    return (media_kind(media), tuple(media.shape[1:]))


def sample_pixels(media) -> int:
    """Decoded pixels of one sample: H * W of an image, T * H * W of a video, 0 for audio."""
    if isinstance(media, Audio | list):  # audio, texts
        return 0
    return math.prod(media.shape[1:]) // 3  # the channel dimension (3) of (3, H, W) or (T, 3, H, W)


def scorer_input(parts: list):
    """One call's pieces (slices of requests' media) -> what the scorer is given: uint8 images / video become one
    float32 batch in [0, 1] (x / 255, contiguous: the only float copy), anything else is concatenated as is."""
    if isinstance(parts[0], torch.Tensor) and parts[0].dtype == torch.uint8:
        media = parts[0] if len(parts) == 1 else torch.cat(parts)
        return media.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    return media_cat(parts)


def score_call(reward, parts: list, prompts: list[str], metadata: list[dict],
               group_ids: torch.Tensor | None = None) -> RewardOutput:
    """One scorer call, in the scorer's thread (the batch is assembled there too, off the server's event loop):
    the float copy lives only as long as the call."""
    return call_reward(reward, scorer_input(parts), prompts, metadata, group_ids=group_ids)


def group_pieces(groups: list | None, n: int, step: int) -> list[tuple[int, int]]:
    """(start, stop) pieces of at most `step` samples; with `groups` (members contiguous) cut between groups only."""
    if groups is None:
        return [(start, min(n, start + step)) for start in range(0, n, step)]
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or groups[i] != groups[start]:
            runs.append((start, i))
            start = i
    pieces: list[tuple[int, int]] = []
    for a, b in runs:
        if pieces and b - pieces[-1][0] <= step:
            pieces[-1] = (pieces[-1][0], b)
        else:
            pieces.append((a, b))
    return pieces


@dataclass(eq=False)  # compared by identity (a field-wise == would compare the media tensors)
class _Job:
    media: torch.Tensor | Audio  # images (n, 3, H, W), video (n, T, 3, H, W) (uint8 or float) or Audio
    prompts: list[str]
    metadata: list[dict]
    future: asyncio.Future
    arrival: int  # order of arrival: the tie-break between equally served requests
    scores: list[float | None] = field(default_factory=list)
    extras: dict[str, list] = field(default_factory=dict)
    pending: list[_Piece] = field(default_factory=list)  # pieces not yet taken into a call, in order
    remaining: int = 0  # pieces not yet scored
    served: int = 0  # work taken into calls so far (pixels; samples for audio): the scheduling priority
    key: tuple = ()  # media_key(media): only pieces of one key are merged
    groups: list | None = None  # per-sample group ids of a group reward's request


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

    @property
    def pixels(self) -> int:
        return self.size * sample_pixels(self.job.media)


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

    def __init__(self, reward, max_batch: int = 64, max_wait_s: float = 0.005, max_call_pixels: int = 2**25):
        if max_batch < 1 or max_call_pixels < 1:
            raise ValueError(f"max_batch={max_batch} and max_call_pixels={max_call_pixels} must be >= 1")
        self.reward, self.max_batch, self.max_wait_s = reward, max_batch, max_wait_s
        self.max_call_pixels = max_call_pixels
        self._jobs: list[_Job] = []  # requests with pieces not yet taken into a call
        self._arrivals = itertools.count()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-scorer")
        self._worker: asyncio.Task | None = None
        # "images": the samples scored (images, videos or audio clips); "peak_call_pixels": the largest call
        self.stats = {"requests": 0, "images": 0, "scorer_calls": 0, "scorer_errors": 0, "peak_call_pixels": 0}

    def samples_per_call(self, media) -> int:
        """How many samples of this batch fit in one call: `max_batch`, fewer when they are large (at least 1)."""
        pixels = sample_pixels(media)
        return min(self.max_batch, max(1, self.max_call_pixels // pixels)) if pixels else self.max_batch

    async def score(self, media, prompts: list[str], metadata: list[dict],
                    groups: list | None = None) -> tuple[list, dict, dict]:
        """(scores, per-sample extras, other extras) for one request; `groups`: its per-sample group ids."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())
        n, step = media_len(media), self.samples_per_call(media)
        job = _Job(media, prompts, metadata, asyncio.get_running_loop().create_future(), next(self._arrivals),
                   [None] * n, key=media_key(media), groups=groups)
        job.pending = [_Piece(job, start, stop) for start, stop in group_pieces(groups, n, step)]
        job.remaining = len(job.pending)
        self._jobs.append(job)
        self.stats["requests"] += 1
        self._arrived.set()
        return await job.future

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ worker
    def _least_served(self) -> list[_Job]:
        """Requests with pieces left, least served first (ties: first arrived)."""
        self._jobs = [j for j in self._jobs if j.pending and not j.future.done()]
        return sorted(self._jobs, key=lambda j: (j.served, j.arrival))

    def _take(self, piece: _Piece, batch: list[_Piece]) -> None:
        piece.job.pending.remove(piece)
        piece.job.served += piece.pixels or piece.size
        batch.append(piece)

    def _fill(self, batch: list[_Piece]) -> None:
        """Add pieces of the call's key, least-served requests first, while they fit."""
        size, pixels = sum(p.size for p in batch), sum(p.pixels for p in batch)
        for job in self._least_served():
            if job.key != batch[0].key:
                continue
            for piece in list(job.pending):
                if size + piece.size > self.max_batch or pixels + piece.pixels > self.max_call_pixels:
                    break
                self._take(piece, batch)
                size, pixels = size + piece.size, pixels + piece.pixels

    def _full(self, batch: list[_Piece]) -> bool:
        return (sum(p.size for p in batch) >= self.max_batch
                or sum(p.pixels for p in batch) >= self.max_call_pixels)

    async def _take_batch(self) -> list[_Piece]:
        while not self._least_served():
            self._arrived.clear()
            await self._arrived.wait()
        batch: list[_Piece] = []
        self._take(self._least_served()[0].pending[0], batch)
        deadline = time.monotonic() + self.max_wait_s
        while True:
            self._fill(batch)
            left = deadline - time.monotonic()
            if left <= 0 or self._full(batch):
                return batch
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                self._fill(batch)
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
        job.pending.clear()
        if not job.future.done():
            job.future.set_exception(error)

    async def _score_pieces(self, loop, batch: list[_Piece]) -> None:
        parts = [media_slice(p.job.media, p.start, p.stop) for p in batch]
        prompts = [x for p in batch for x in p.job.prompts[p.start : p.stop]]
        metadata = [x for p in batch for x in p.job.metadata[p.start : p.stop]]
        group_ids = None
        if any(p.job.groups is not None for p in batch):  # distinct ids across the call's requests
            labels = [(p.job.arrival, p.job.groups[i] if p.job.groups is not None else ("sample", i))
                      for p in batch for i in range(p.start, p.stop)]
            dense: dict = {}
            group_ids = torch.tensor([dense.setdefault(x, len(dense)) for x in labels], dtype=torch.long)
        self.stats["scorer_calls"] += 1
        self.stats["peak_call_pixels"] = max(self.stats["peak_call_pixels"], sum(p.pixels for p in batch))
        try:
            out = await loop.run_in_executor(self._executor, score_call, self.reward, parts, prompts, metadata,
                                             group_ids)
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
