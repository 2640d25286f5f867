"""The training loop's stages for token policies (the loop dispatches on the model's policy kind, models/base.py).

One step: draw the step's prompt groups, sample every response with its per-token log-probs (`sampling/tokens.py`),
score the texts, shape the rewards (the algorithm's `shape_rewards`), compute group advantages over the whole
step, then the actor's update. An algorithm that declares `dynamic_sampling` (DAPO) keeps only the groups whose
rewards differ and draws fresh prompt groups again, up to `max_refills` more rollouts, until the step has
`data.prompts_per_step` such groups (logged: `dapo/refills`, `dapo/kept_groups`; a step that ends short trains on
the groups it has). The held-out evaluation decodes greedily.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..algorithms import compute_advantages
from ..algorithms.advantage import zero_std_ratio
from ..batch import Rollout, TokenBatch
from ..data.prompts import split_row
from ..perf.timer import StageTimer
from ..rewards.stage import score_batch
from ..sampling.tokens import TokenPlan, draw_uniforms, pad_left, pad_right, token_rollout


def token_plan_from_config(r: DictConfig) -> TokenPlan:
    return TokenPlan(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, stop=tuple(r.stop),
                     batch_size=r.batch_size)


def flat_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(G,) bool per group id 0..G−1: its rewards are all equal (no learning signal)."""
    g = int(group_ids.max()) + 1
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, group_ids, rewards.double(), "amin")
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group_ids, rewards.double(), "amax")
    return lo == hi


def response_metrics(batches: list[Rollout], engine, max_new_tokens: int) -> dict[str, float]:
    """Mean / max response length of every sample this step, and the share cut at max_new_tokens without ending."""
    lengths = engine.gather(torch.cat([b.tokens.response_mask.sum(1).float() for b in batches]))
    return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean())}


def token_step(trainer) -> dict:
    """One training step of a token policy (see the module docstring); returns its metrics."""
    tr, cfg = trainer, trainer.cfg
    engine, algo, adapter, plan = tr.engine, tr.algo, tr.adapter, tr.plan
    n, k = cfg.rollout.n, cfg.data.prompts_per_step
    timer = StageTimer(tr.device)
    flops_before = adapter.flops
    from .loop import reward_metrics, step_generator  # (the loop imports this module)

    generator = step_generator(cfg.trainer.seed, tr.step)
    rounds = 1 + (algo.max_refills if algo.dynamic_sampling else 0)
    kept: list[Rollout] = []  # this rank's samples of the kept groups
    kept_rewards: list[torch.Tensor] = []  # the kept groups' (shaped) rewards, every rank's, in global order
    positions: list[torch.Tensor] = []  # where this rank's kept samples are in that global order
    sampled: list[Rollout] = []
    raw_rewards: list[torch.Tensor] = []
    kept_groups = 0
    with timer("step"):
        for refills in range(rounds):  # the first rollout, then the refills  # noqa: B007  (read after the loop)
            rows = tr.sampler.next(k)  # the global step: every rank draws the same rows
            group_ids = torch.arange(len(rows)).repeat_interleave(n)
            share = engine.shard(len(rows))
            mine = torch.arange(share.start * n, share.stop * n)
            prompts, metadata = [], []
            for row in rows[share.start:share.stop]:
                prompt, meta = split_row(row)
                prompts += [prompt] * n
                metadata += [meta] * n
            uniforms = draw_uniforms(len(group_ids), plan, generator)[mine]  # the whole step's draws, then ours
            scoring = tr.reward_stage.begin(prompts, metadata)
            try:
                with timer("rollout"), tr.actor.sampling_policy():
                    batch = token_rollout(adapter, prompts, metadata, group_ids[mine], plan, uniforms, sink=scoring)
            except BaseException:
                scoring.cancel()
                raise
            scoring.finish(batch, timer)
            sampled.append(batch)
            raw_rewards.append(engine.gather(batch.rewards))
            batch.rewards = algo.shape_rewards(batch)
            rewards = engine.gather(batch.rewards)  # global sample order
            take = torch.ones(len(rows), dtype=torch.bool)
            if algo.dynamic_sampling:
                take = ~flat_groups(rewards, group_ids)
                take &= take.cumsum(0) <= k - kept_groups  # at most the groups still missing
            kept_groups += int(take.sum())
            keep_samples = take[group_ids]
            local = torch.nonzero(keep_samples[mine]).flatten()
            before = sum(len(x) for x in kept_rewards)
            positions.append(before + keep_samples.long().cumsum(0)[mine][local] - 1)
            kept.append(batch.select(local))
            kept_rewards.append(rewards[keep_samples])
            if not algo.dynamic_sampling or kept_groups >= k:
                break
        batch = Rollout.cat(kept) if len(kept) > 1 else kept[0]
        rewards = torch.cat(kept_rewards)
        global_groups = torch.arange(len(rewards) // n).repeat_interleave(n)
        mine_kept = torch.cat(positions)
        advantages = compute_advantages(algo, rewards, global_groups) if len(rewards) else torch.zeros(0)
        batch.advantages = advantages[mine_kept]
        batch.group_ids = global_groups[mine_kept]
        with timer("train"):
            stats = tr._update(batch, step_generator(cfg.trainer.seed, tr.step, stream=1))
    timings = timer.times
    step_flops = float(engine.sum(torch.tensor(adapter.flops - flops_before, dtype=torch.float64, device=engine.device)))
    if step_flops > 0:
        timings["perf/tflops"] = step_flops / 1e12
        timings["perf/achieved_tflops_per_s"] = step_flops / 1e12 / timings["time/step"]
        if cfg.trainer.peak_tflops:
            timings["perf/mfu"] = timings["perf/achieved_tflops_per_s"] / (cfg.trainer.peak_tflops * engine.world_size)
    raw = torch.cat(raw_rewards)
    first_groups = torch.arange(len(raw_rewards[0]) // n).repeat_interleave(n)
    metrics = {
        "step": tr.step + 1,
        "reward/mean": float(raw.mean()),
        "reward/std": float(raw.std(unbiased=False)),
        "zero_std_ratio": zero_std_ratio(raw_rewards[0], first_groups),
        "adv/abs_mean": float(advantages.abs().mean()) if len(advantages) else 0.0,
        **response_metrics(sampled, engine, plan.max_new_tokens),
        **stats,
        "lr": tr.actor.optimizer.param_groups[0]["lr"],
        **timings,
    }
    if algo.dynamic_sampling:
        metrics.update({"dapo/refills": float(refills), "dapo/kept_groups": float(kept_groups)})
    metrics.update(reward_metrics(engine.gather_objects((len(sampled[0]), sampled[0].reward_extras))))
    return metrics


@torch.no_grad()
def evaluate_tokens(adapter, reward, cfg: DictConfig, rows: list[dict], plan: TokenPlan, n: int | None = None):
    """Held-out reward: greedy decoding of the first n rows (the same responses for the same weights)."""
    n = n or cfg.trainer.eval_samples
    picked = [rows[i % len(rows)] for i in range(n)]
    prompts, metadata = zip(*(split_row(r) for r in picked), strict=True)
    greedy = replace(plan, temperature=0.0, top_p=1.0)
    uniforms = torch.zeros((n, greedy.max_new_tokens), dtype=torch.float64)
    batch = token_rollout(adapter, list(prompts), list(metadata), torch.arange(n), greedy, uniforms)
    score_batch(reward, cfg.reward.name, batch)
    return float(batch.rewards.mean()), batch


def save_text_samples(batch: Rollout, path: Path, baselines: dict[str, float] | None = None) -> Path:
    """Every evaluated sample as a JSON line {prompt, response, reward}, to read what the policy answers (no
    `response` for a policy whose media are not text); decoded media of other kinds (Janus-Pro's images) are also
    written as `save_samples` writes a diffusion model's (`<path without .jsonl>.png`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    media = batch.media or {}
    texts = media.get("text", [None] * len(batch))
    with path.open("w") as f:
        for i, (prompt, text) in enumerate(zip(batch.prompts, texts, strict=True)):
            row = {"prompt": prompt if isinstance(prompt, str) else prompt.get("text"),
                   **({"response": text} if text is not None else {}),
                   "reward": float(batch.rewards[i]), **{k: v for k, v in batch.metadata[i].items() if k == "answer"}}
            f.write(json.dumps(row) + "\n")
    if set(media) - {"text"}:
        from .logging import save_samples

        save_samples(batch, path.with_suffix(""))
    return path


@torch.no_grad()
def token_pair_batch(adapter, rows: list[dict]) -> Rollout:
    """Offline DPO pairs (data/text_pairs.py rows) -> a batch: the chosen responses in `tokens`, the rejected ones
    in `extras["rejected_tokens"]`, both ending with EOS as generated responses do."""
    prompts = [r["prompt"] for r in rows]
    prompt_ids, cond = adapter.encode_prompts(prompts)
    pad = adapter.pad_token_id
    chosen, rejected = adapter.encode_responses([r["chosen"] for r in rows]), adapter.encode_responses(
        [r["rejected"] for r in rows])
    width = max(len(s) for s in chosen + rejected)
    p_ids, p_mask = pad_left(prompt_ids, pad)
    b = len(rows)

    def tokens(responses: list[list[int]]) -> TokenBatch:
        ids, mask = pad_right(responses, pad, width)
        return TokenBatch(p_ids, p_mask, ids, mask, pad)

    return Rollout(
        prompts=prompts, metadata=[{k: v for k, v in r.items() if k not in ("prompt", "chosen", "rejected")} for r in rows],
        group_ids=torch.arange(b), cond={k: v.cpu() for k, v in cond.items()}, shared={}, latents={},
        log_probs=torch.zeros(b, width), sigmas=torch.zeros(b, 0), noise_levels=torch.zeros(b, 0), final={},
        tokens=tokens(chosen), extras={"rejected_tokens": tokens(rejected)},
    )
