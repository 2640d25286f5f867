"""One training step, the same for every policy kind: prompts → rollout → reward → (filter and refill) →
advantages → update → weight sync. What differs by kind sits behind the sampler (sampling/base.py PolicySampler)
and the actor; this module never asks which kind it runs.

Offline preference pairs (data.pairs_path) are another source of the same update: `pair_step` turns the step's
pairs into a batch (the kind's pair format, data/) and runs the update path of the online step.

Every rank draws the same rows (the global step) and rolls out its contiguous share of whole prompt groups;
rewards and advantages span the global batch. Dynamic sampling (`algorithm.dynamic_sampling`, any algorithm; DAPO's
filter-and-refill, docs/algorithms.md §5) keeps only the groups whose rewards differ and draws fresh groups, up to
`algorithm.max_refills` more rollouts, until the step has `data.prompts_per_step` such groups; a step that ends
short trains on the groups it has and logs how many (`<algorithm>/refills`, `<algorithm>/kept_groups`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..algorithms import compute_advantages
from ..algorithms.advantage import advantage_parts, part_metrics, zero_std_ratio
from ..batch import Rollout
from ..data.prompts import split_row
from ..perf.timer import StageTimer
from ..rewards.base import is_caption_key
from ..rewards.mix import reward_terms
from ..rewards.stage import merge_extras
from ..sampling.base import UPDATE_STREAM, repeat_rows, step_generator


@dataclass
class Stages:
    """The run's stages as the step uses them (built once by the Trainer)."""

    source: object  # data/prompts.py PromptSampler: the step's rows (prompt rows, or pairs)
    sampler: object  # sampling/base.py PolicySampler of the model's kind
    reward_stage: object  # rewards/stage.py RewardStage (or its Ray twin)
    algo: object
    actor: object
    engine: object
    update: Callable[[Rollout, torch.Generator], dict]  # the actor's update, behind the trainer's weight snapshot
    sync: Callable[[], dict] | None = None  # Ray rollout replicas get the new weights (None: they are the actor's)
    extra_gpus: float = 0.0  # GPUs beside the actor's ranks (Ray workers): MFU counts them


def flat_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(G,) bool per group id 0..G−1: its rewards are all equal (no learning signal)."""
    g = int(group_ids.max()) + 1
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, group_ids, rewards.double(), "amin")
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group_ids, rewards.double(), "amax")
    return lo == hi


def groups_to_keep(rewards: torch.Tensor, group_ids: torch.Tensor, missing: int, dynamic: bool) -> torch.Tensor:
    """(G,) bool: every group, or with dynamic sampling the first `missing` groups whose rewards differ."""
    keep = torch.ones(int(group_ids.max()) + 1, dtype=torch.bool)
    if dynamic:
        keep = ~flat_groups(rewards, group_ids)
        keep &= keep.cumsum(0) <= missing
    return keep


def reward_metrics(parts: list[tuple[int, dict]]) -> dict[str, float]:
    """Mean of each reward extra over the finite values of every rank's samples (`(samples, extras)` per rank)."""
    out = {}
    for k, v in merge_extras(parts).items():
        if is_caption_key(k):  # per-sample strings for the sample grids
            continue
        vals = [float(x) for x in v if x is not None and not (isinstance(x, float) and math.isnan(x))]
        if vals:
            # per-component scores of a mix are logged under their own name (reward/<component>)
            out[k if k.startswith("reward/") else f"reward_extra/{k}"] = sum(vals) / len(vals)
    return out


class KeptGroups:
    """The groups a step trains on, gathered over its rollouts: this rank's samples, every rank's rewards in the
    global order of the kept groups, and where this rank's samples sit in that order."""

    def __init__(self):
        self.batches: list[Rollout] = []
        self.rewards: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.terms: list[torch.Tensor] | None = []  # reward=mix's terms of the kept samples (None: not every rollout)
        self.labels: list[str] | None = None
        self.count = 0

    def add(self, batch: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor, mine: slice,
            keep: torch.Tensor, terms: tuple[list[str], torch.Tensor] | None = None) -> None:
        """`terms`: (labels, every rank's (B, C) terms of the reward), reward=mix's."""
        self.count += int(keep.sum())
        keep_samples = keep[group_ids]
        if terms is None or self.terms is None or (self.labels is not None and terms[0] != self.labels):
            self.terms = None
        else:
            self.labels = terms[0]
            self.terms.append(terms[1][keep_samples])
        before = sum(len(r) for r in self.rewards)
        if bool(keep.all()):  # nothing dropped: no copy of the batch
            local = torch.arange(len(batch))
            self.batches.append(batch)
        else:
            local = torch.nonzero(keep_samples[mine]).flatten()
            self.batches.append(batch.select(local))
        self.positions.append(before + keep_samples.long().cumsum(0)[mine][local] - 1)
        self.rewards.append(rewards[keep_samples])

    def advantage_parts(self, algo, n: int) -> dict[str, float]:
        """Each reward=mix component's part of the step's advantages (algorithms/advantage.py `advantage_parts`)."""
        if not self.terms or self.labels is None:
            return {}
        rewards = torch.cat(self.rewards)
        group_ids = torch.arange(len(rewards) // n).repeat_interleave(n)
        parts = advantage_parts(torch.cat(self.terms), rewards, group_ids, getattr(algo, "adv_std", "global"))
        return part_metrics(self.labels, parts)

    def training_batch(self, algo, n: int) -> tuple[Rollout, torch.Tensor]:
        """(this rank's batch with its advantages and renumbered group ids, every kept sample's advantage)."""
        batch = Rollout.cat(self.batches) if len(self.batches) > 1 else self.batches[0]
        rewards = torch.cat(self.rewards)
        group_ids = torch.arange(len(rewards) // n).repeat_interleave(n)
        mine = torch.cat(self.positions)
        advantages = compute_advantages(algo, rewards, group_ids) if len(rewards) else torch.zeros(0)
        batch.advantages = advantages[mine]
        batch.group_ids = group_ids[mine]
        batch.sample_index = mine  # its place in the global order (keys the update's draws and mini-batches)
        return batch, advantages


def step_rows(stages: Stages, rows: list, n: int) -> tuple[list, list[dict], torch.Tensor, slice]:
    """(this rank's prompts and metadata, every sample's group id, this rank's samples) of a step's rows."""
    share = stages.engine.shard(len(rows))
    prompts, metadata = repeat_rows(rows[share.start:share.stop], n, split_row)
    return prompts, metadata, torch.arange(len(rows)).repeat_interleave(n), slice(share.start * n, share.stop * n)


def train_step(stages: Stages, cfg, step: int) -> dict:
    """One online step (see the module docstring); returns its metrics."""
    s, engine, algo = stages, stages.engine, stages.algo
    n, k = cfg.rollout.n, cfg.data.prompts_per_step
    timer = StageTimer(engine.device)
    adapter = s.actor.adapter
    flops_before = getattr(adapter, "flops", 0.0)
    attempts = 1 + (algo.max_refills if algo.dynamic_sampling else 0)
    kept, sampled, raw_rewards = KeptGroups(), [], []
    with timer("step"):
        for attempt in range(attempts):  # the first rollout, then the refills
            rows = s.source.next(k)  # the global step: every rank draws the same rows
            prompts, metadata, group_ids, mine = step_rows(s, rows, n)
            draws = s.sampler.draws(group_ids, mine, step, attempt)
            # reward: after the rollout, or chunk by chunk during it (reward.async, rewards/stage.py)
            scoring = s.reward_stage.begin(prompts, metadata, group_ids[mine])  # group rewards: whole groups
            try:
                batch = s.sampler.rollout(prompts, metadata, group_ids[mine], draws, scoring, timer)
            except BaseException:
                scoring.cancel()
                raise
            scoring.finish(batch, timer)
            del draws  # freed before the next draws (a video run's noise is gigabytes on the host)
            sampled.append(batch)
            raw_rewards.append(engine.gather(batch.rewards))  # the step's rewards, in global sample order
            batch.rewards = algo.shape_rewards(batch)
            rewards = engine.gather(batch.rewards)
            terms = reward_terms(batch.reward_extras or {}, len(batch))  # reward=mix: each component's term
            kept.add(batch, rewards, group_ids, mine, groups_to_keep(rewards, group_ids, k - kept.count,
                                                                     algo.dynamic_sampling),
                     None if terms is None else (terms[0], engine.gather(terms[1])))
            if kept.count >= k:
                break
        batch, advantages = kept.training_batch(algo, n)
        parts = kept.advantage_parts(algo, n)

        def peek(ahead: int) -> tuple[list, list[dict]]:  # the rows `ahead` steps on, the data position kept
            before = s.source.state_dict()
            try:
                for _ in range(ahead - 1):
                    s.source.next(k)
                return step_rows(s, s.source.next(k), n)[:2]
            finally:
                s.source.load_state_dict(before)

        s.sampler.prepare_next(step, group_ids, mine, cfg.trainer.max_steps, peek)
        with timer("train"):
            stats = s.update(batch, step_generator(cfg.trainer.seed, step, UPDATE_STREAM))
        if s.sync is not None:
            with timer("weight_sync"):
                stats.update(s.sync())
        s.reward_stage.end_step()  # the step trained: reward=mix's running statistics take its scores
    raw = torch.cat(raw_rewards)
    first_groups = torch.arange(len(raw_rewards[0]) // n).repeat_interleave(n)
    metrics = {
        "step": step + 1,
        "reward/mean": float(raw.mean()),
        "reward/std": float(raw.std(unbiased=False)),
        "zero_std_ratio": zero_std_ratio(raw_rewards[0], first_groups),
        "adv/abs_mean": float(advantages.abs().mean()) if len(advantages) else 0.0,
        **s.sampler.metrics(sampled, engine),
        **stats,
        "lr": s.actor.optimizer.param_groups[0]["lr"],
        **timings(stages, cfg, timer, flops_before),
        **parts,
    }
    if algo.dynamic_sampling:
        name = cfg.algorithm.name
        metrics.update({f"{name}/refills": float(attempt), f"{name}/kept_groups": float(kept.count)})
    metrics.update(reward_metrics(engine.gather_objects((len(sampled[0]), sampled[0].reward_extras))))
    return metrics


def peak_memory(device: torch.device) -> dict[str, float]:
    """On a GPU, the most this rank's allocator has held since the run started (`memory/peak_gib`)."""
    return {"memory/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}


def timings(stages: Stages, cfg, timer: StageTimer, flops_before: float) -> dict[str, float]:
    """The step's stage seconds, its FLOPs and MFU where the model counts them (summed over ranks), and on a GPU the
    peak memory so far (rank 0's)."""
    engine, out = stages.engine, timer.times
    out.update(peak_memory(engine.device))
    flops = getattr(stages.actor.adapter, "flops", 0.0) - flops_before
    step_flops = float(engine.sum(torch.tensor(flops, dtype=torch.float64, device=engine.device)))
    if step_flops > 0:
        out["perf/tflops"] = step_flops / 1e12
        out["perf/achieved_tflops_per_s"] = step_flops / 1e12 / out["time/step"]
        if cfg.trainer.peak_tflops:
            gpus = engine.world_size + stages.extra_gpus
            out["perf/mfu"] = out["perf/achieved_tflops_per_s"] / (cfg.trainer.peak_tflops * gpus)
    return out


def pair_step(stages: Stages, cfg, step: int, pairs) -> dict:
    """One update on a batch of offline preference pairs: the kind's pair format encodes them, then the update."""
    timer = StageTimer(stages.engine.device)
    with timer("step"):
        with timer("encode"):
            share = stages.engine.shard(cfg.data.prompts_per_step)
            rows = stages.source.next(cfg.data.prompts_per_step)[share.start:share.stop]
            batch = pairs.batch(stages.actor.adapter, rows)
        with timer("train"):
            stats = stages.update(batch, step_generator(cfg.trainer.seed, step, UPDATE_STREAM))
    return {"step": step + 1, **stats, "lr": stages.actor.optimizer.param_groups[0]["lr"], **timer.times,
            **peak_memory(stages.engine.device)}
