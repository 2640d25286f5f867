"""The reward stage of a training step: score decoded media (and/or latents), attach scores to the batch.

It never holds the generator: the rollout stage decodes each chunk and hands it over as a `MediaChunk`
(sampling/diffusion.py) through `scoring.put`, so this stage could live in another process. Two schedules, the
same numbers:

* sync (`reward.async=false`): after the whole rollout, score the batch in one call.
* overlapped (`reward.async=true`): as soon as chunk i is sampled and its decode queued, a worker thread scores
  it while the main thread samples chunk i+1. (The decode stays on the main thread: it is GPU work on the same
  stream either way, and a compiled decoder compiling in a worker would break the main thread's compiled calls:
  torch.fx's tracing flag is process-wide.)

Why inside one step and not across steps: the rollout of step k+1 must use the weights after step k's update,
and that update needs step k's rewards (the advantages are normalised over whole groups). Scoring step k while
step k+1 is sampled would therefore sample step k+1 from one-update-old weights (off-policy by one step).
Overlapping chunks of one step keeps every sample on-policy; what is not hidden is the decode + score of the
last chunk (and everything, when the batch is one chunk: set `rollout.batch_size` below the step's samples).

The overlapped schedule of a pointwise reward (a sample's score does not depend on the other samples of the call)
scores each chunk as it comes; both schedules then give identical scores and training.

A group reward (`groupwise`, rewards/base.py) must see each prompt group whole, and a chunk of
`rollout.batch_size` samples may end inside a group. Its overlapped schedule (`_GroupOverlapped`) keeps the chunks
that came and, after each one, scores the groups that became complete (every member arrived), in one call: a
group is never cut and never mixed with a partial group, whatever the chunking, so both schedules give the same
scores. That needs the step's group ids at `begin`; without them the scoring waits for `finish` (then the whole
batch in one call, grouped by `batch.group_ids`, as in the sync schedule). In a data-parallel run each rank holds
whole groups (trainer/step.py `step_rows`), so a group reward runs per rank on its own groups.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ..batch import Rollout
from ..media import primary
from .base import RewardOutput, call_reward, group_members, is_groupwise, media_cat, media_take, reward_inputs


class RewardUnavailable(RuntimeError):
    """A reward service that could not score the batch: still failing after its retry budget, or refusing
    the request. The trainer saves a checkpoint of the last completed step and stops with this message
    (it names the service and the last error)."""


def checked_scores(out: RewardOutput, name: str, n: int) -> torch.Tensor:
    """(n,) float32 scores; a wrong count or a non-finite score stops the step (never trained on)."""
    scores = torch.as_tensor(out.scores, dtype=torch.float32).reshape(-1)
    if scores.numel() != n or not torch.isfinite(scores).all():
        raise RuntimeError(
            f"reward {name!r} returned {scores.numel()} scores for {n} images "
            f"(non-finite: {int((~torch.isfinite(scores)).sum())}); refusing to train on them"
        )
    return scores


def score_batch(reward, name: str, batch: Rollout) -> None:
    """Score the batch in one call (decoded media and/or latents, as the reward declares) and attach
    `rewards` and `reward_extras`; media the reward made (`RewardOutput.media`) join the batch's media where it has
    none of that kind (a text policy's batch gains the images its rewrites were rendered to)."""
    out = call_reward(reward, primary(batch.media), batch.prompts, batch.metadata, latents=reward_latents(batch.final),
                      group_ids=batch.group_ids)
    batch.rewards, batch.reward_extras = checked_scores(out, name, len(batch)), out.extras
    made = getattr(out, "media", None) or {}
    if made:
        batch.media = {**made, **(batch.media or {})}


def reward_latents(final: dict) -> torch.Tensor | dict:
    """Latents as a reward reads them: the tensor of a one-entry model, the dict otherwise."""
    return next(iter(final.values())) if len(final) == 1 else final


def _as_list(value, n: int) -> list:
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    value = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(value) != n:
        raise ValueError(f"an extra of length {len(value)} for a chunk of {n} samples")
    return value


def merge_extras(parts: list[tuple[int, dict]]) -> dict[str, list]:
    """Per-sample extras of consecutive chunks `(chunk size, extras)` -> one list per name over all samples.

    A name missing from a chunk is None for that chunk's samples (the metrics skip None, so a diagnostic that
    one chunk did not produce is not counted as 0). Non-finite floats are kept as they are.
    """
    names: list[str] = []
    for _, extras in parts:
        names += [k for k in extras if k not in names]
    return {k: sum((_as_list(e[k], n) if k in e else [None] * n for n, e in parts), []) for k in names}


class WallTimer:
    """`with timer("x"): ...` adds wall seconds to `timer.times["time/x"]` (the trainer passes its own stage
    timer, which also synchronises the GPU)."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - t0


class _Worker:
    """What the overlapped schedules share: the scoring calls queued on the stage's worker thread, waiting for them
    (timed as `reward_wait`: the part not hidden behind sampling), and the worker's busy seconds (`time/reward`)."""

    def __init__(self, stage: RewardStage, prompts: list, metadata: list[dict]):
        self.stage, self.prompts, self.metadata = stage, prompts, metadata
        self.futures: list[Future] = []
        self.busy = {"time/reward": 0.0}

    def _results(self, timer: WallTimer) -> list:
        try:
            with timer("reward_wait"):
                return [f.result() for f in self.futures]
        finally:
            self.cancel()

    def _times(self, timer: WallTimer) -> dict[str, float]:
        for k, v in self.busy.items():
            timer.times[k] = timer.times.get(k, 0.0) + v
        return timer.times

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


class _Overlapped(_Worker):
    """One step's overlapped scoring: `put(chunk)` submits the chunk's scoring to the worker, `finish` collects."""

    def put(self, chunk) -> None:
        self.futures.append(self.stage.executor.submit(self._work, chunk))

    def _work(self, chunk):
        chunk.ready()  # the media are on the host
        with torch.no_grad():  # grad mode is per thread
            t1 = time.perf_counter()
            prompts, metadata = self.prompts[chunk.index], self.metadata[chunk.index]
            out = call_reward(self.stage.reward, primary(chunk.media), prompts, metadata,
                              latents=reward_latents(chunk.final))
            scores = checked_scores(out, self.stage.name, len(prompts))
        # one worker thread: no lock needed
        self.busy["time/reward"] += time.perf_counter() - t1
        return scores, out.extras

    def finish(self, batch: Rollout, timer: WallTimer | None = None) -> dict[str, float]:
        """Wait for the chunks (timed as `reward_wait`: the part not hidden behind sampling) and attach the
        results; the worker's busy seconds go to `time/reward`."""
        timer = timer or WallTimer()
        results = self._results(timer)
        n = sum(len(s) for s, _ in results)
        if n != len(batch):
            raise RuntimeError(f"overlapped reward scored {n} of {len(batch)} samples: the rollout did not "
                               "hand every chunk to the reward stage")
        batch.rewards = torch.cat([s for s, _ in results])
        batch.reward_extras = merge_extras([(len(s), e) for s, e in results])
        return self._times(timer)


class _GroupOverlapped(_Worker):
    """One step's overlapped scoring for a group reward: chunks are kept until groups are complete; each `put` submits
    the groups it completed (one call for all of them) to the worker, `finish` puts the scores back in sample order.
    """

    def __init__(self, stage: RewardStage, prompts: list, metadata: list[dict], group_ids: torch.Tensor):
        super().__init__(stage, prompts, metadata)
        self.group_ids = torch.as_tensor(group_ids).reshape(-1).long().cpu()
        if len(self.group_ids) != len(prompts):
            raise ValueError(f"reward stage: {len(self.group_ids)} group ids for {len(prompts)} samples")
        self.members = group_members(self.group_ids)
        self.arrived = torch.zeros(len(prompts), dtype=torch.bool)
        self.pending = list(range(len(self.members)))  # groups not yet submitted
        self.chunks: list = []

    def put(self, chunk) -> None:
        self.chunks.append(chunk)
        self.arrived[chunk.index] = True
        done = [g for g in self.pending if bool(self.arrived[self.members[g]].all())]
        if not done:
            return
        self.pending = [g for g in self.pending if g not in done]
        idx = [i for g in done for i in self.members[g]]  # group by group
        self.futures.append(self.stage.executor.submit(self._work, idx, list(self.chunks)))

    def _gather(self, idx: list[int], chunks: list):
        """(media, final latents) of samples `idx`, in that order, from the chunks that hold them."""
        media, final, order = [], [], []
        for c in chunks:
            local = [i - c.index.start for i in idx if c.index.start <= i < c.index.stop]
            if not local:
                continue
            c.ready()  # the media are on the host
            media.append(media_take(primary(c.media), local))
            final.append({k: v[torch.as_tensor(local)] for k, v in c.final.items()})
            order += [c.index.start + j for j in local]
        pos = {i: p for p, i in enumerate(order)}
        back = [pos[i] for i in idx]  # the chunks' order -> idx's order
        cat = media_cat(media) if media and media[0] is not None else None
        lat = {k: torch.cat([f[k] for f in final])[back] for k in final[0]} if final else {}
        return (media_take(cat, back) if cat is not None else None), lat

    def _work(self, idx: list[int], chunks: list):
        with torch.no_grad():  # grad mode is per thread
            t1 = time.perf_counter()
            media, final = self._gather(idx, chunks)
            out = call_reward(self.stage.reward, media, [self.prompts[i] for i in idx],
                              [self.metadata[i] for i in idx], latents=reward_latents(final) if final else None,
                              group_ids=self.group_ids[idx])
            scores = checked_scores(out, self.stage.name, len(idx))
        self.busy["time/reward"] += time.perf_counter() - t1
        return idx, scores, out.extras

    def finish(self, batch: Rollout, timer: WallTimer | None = None) -> dict[str, float]:
        timer = timer or WallTimer()
        results = self._results(timer)
        n = len(batch)
        if self.pending or sum(len(i) for i, _, _ in results) != n:
            raise RuntimeError(f"the group reward scored {sum(len(i) for i, _, _ in results)} of {n} samples "
                               f"({len(self.pending)} groups never completed): the rollout did not hand every chunk "
                               "to the reward stage")
        batch.rewards = torch.empty(n, dtype=torch.float32)
        for idx, scores, _ in results:
            batch.rewards[idx] = scores
        batch.reward_extras = scatter_extras([(idx, e) for idx, _, e in results], n)
        return self._times(timer)


def scatter_extras(parts: list[tuple[list[int], dict]], n: int) -> dict[str, list]:
    """Per-sample extras of calls over sample sets `idx` -> one list per name in sample order (None where a call
    did not produce that name)."""
    out: dict[str, list] = {}
    for idx, extras in parts:
        for k, v in extras.items():
            column = out.setdefault(k, [None] * n)
            for i, x in zip(idx, _as_list(v, len(idx)), strict=True):
                column[i] = x
    return out


class _Sync:
    def put(self, chunk) -> None:
        pass  # scored whole in `finish`

    def __init__(self, stage: RewardStage):
        self.stage = stage

    def finish(self, batch: Rollout, timer: WallTimer | None = None) -> dict[str, float]:
        timer = timer or WallTimer()
        with timer("reward"):
            score_batch(self.stage.reward, self.stage.name, batch)
        return timer.times

    def cancel(self) -> None:
        pass


class RewardStage:
    """Per step: `scoring = stage.begin(prompts, metadata)`, then `rollout(..., sink=scoring)`, then
    `scoring.finish(batch, timer)`, which fills `rewards` and `reward_extras` (call `scoring.cancel()` instead
    when the rollout failed). `reads_media` tells the rollout whether to decode at all.

    `timer` records `time/reward` (and `time/reward_wait` when overlapped); `finish` returns its `times`.
    """

    def __init__(self, reward, name: str, overlap: bool = False):
        self.reward, self.name, self.overlap = reward, name, overlap
        self.reads_media = "images" in reward_inputs(reward)
        self.groupwise = is_groupwise(reward)
        # one worker: chunks are scored in order and the reward is never called concurrently
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-reward") if overlap else None

    def begin(self, prompts: list, metadata: list[dict], group_ids: torch.Tensor | None = None):
        """`group_ids` (this rank's samples'): what lets a group reward be scored chunk by chunk (whole groups);
        without them a group reward is scored at `finish`. A reward with a `begin_step` method (a remote judge: its
        per-step retry budget; reward=mix: its running statistics) is told that a training step begins."""
        start = getattr(self.reward, "begin_step", None)
        if start is not None:
            start()
        if self.overlap and self.groupwise:
            if group_ids is None:
                return _Sync(self)
            return _GroupOverlapped(self, list(prompts), list(metadata), group_ids)
        if self.overlap:
            return _Overlapped(self, list(prompts), list(metadata))
        return _Sync(self)

    def end_step(self) -> None:
        """The step trained: a reward with an `end_step` method (reward=mix's running statistics) is told."""
        end = getattr(self.reward, "end_step", None)
        if end is not None:
            end()

    def checkpoint_extra(self) -> dict:
        """What a checkpoint keeps of the reward: {"reward": its `reward_state()`} (reward=mix's running statistics),
        or nothing."""
        get = getattr(self.reward, "reward_state", None)
        return {"reward": get()} if get is not None else {}

    def load_reward_state(self, state: dict | None) -> None:
        load = getattr(self.reward, "load_reward_state", None)
        if state is not None and load is not None:
            load(state)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.reward, "close", None)  # a remote client's connections and event loop
        if close is not None:
            close()
