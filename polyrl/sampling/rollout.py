"""The rollout stage: sample trajectories with log-probs (ALGORITHMS.md §1), decode, return a `Rollout`.

All randomness comes from a `torch.Generator` the caller seeds per training step, so a resumed run draws the
same noise as an uninterrupted one. Noise is drawn on the CPU in float32 and moved, so it does not depend on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import Rollout
from ..models.base import Cond, GeneratorAdapter
from .steps import STEPS

WINDOW_STRATEGIES = ("per_sample", "random", "progressive")


@dataclass
class SamplingPlan:
    """What a rollout samples. `window_size` 0 means every step is stochastic and trained."""

    num_steps: int
    height: int
    width: int
    guidance_scale: float
    noise_level: float
    window_size: int = 0
    window_range: tuple[int, int] = (0, 0)
    batch_size: int = 16  # samples per network call (memory bound)
    step: str = "sde"  # a name in sampling.steps.STEPS
    window_strategy: str = "per_sample"  # see window_starts
    window_every: int = 1  # `progressive`: training steps between slides
    shared_noise: bool = False  # one initial noise per prompt group (DanceGRPO)

    @property
    def trained_steps(self) -> int:
        return self.window_size or self.num_steps


def window_starts(plan: SamplingPlan, batch: int, generator: torch.Generator, step: int = 0) -> torch.Tensor:
    """Window start per sample (§1 SDE window), in `window_range` = [lo, hi] inclusive.

    `per_sample`: each sample uniform in [lo, hi] (Flow-GRPO-Fast); `random`: one uniform start shared by the
    whole batch (MixGRPO random); `progressive`: lo + (⌊step / window_every⌋·W mod (hi − lo + 1)), sliding
    forward by W every `window_every` training steps and wrapping to lo (MixGRPO progressive). The draws come
    from the step's generator, so a resumed run places windows exactly as an uninterrupted one.
    """
    if plan.window_size == 0:
        return torch.zeros(batch, dtype=torch.long)
    lo, hi = plan.window_range
    if plan.window_strategy == "per_sample":
        return torch.randint(lo, hi + 1, (batch,), generator=generator)
    if plan.window_strategy == "random":
        return torch.randint(lo, hi + 1, (1,), generator=generator).expand(batch).clone()
    if plan.window_strategy == "progressive":
        start = lo + (step // plan.window_every) * plan.window_size % (hi - lo + 1)
        return torch.full((batch,), start, dtype=torch.long)
    raise ValueError(f"rollout.sde_window_strategy={plan.window_strategy!r}; allowed: {', '.join(WINDOW_STRATEGIES)}")


@torch.no_grad()
def sample_latents(
    adapter: GeneratorAdapter, cond: Cond, neg: Cond | None, noise: torch.Tensor, plan: SamplingPlan,
    starts: torch.Tensor, step_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the sampler from `noise` with the per-step draws `step_noise` (N, B, ...); returns (window latents,
    log-probs, sigmas, noise levels, final latent, window means). Results stay on the device until the end, so the
    loop never waits for a device-to-host copy."""
    sigmas = adapter.sigmas(plan.num_steps, plan.height, plan.width)
    sigma_1 = float(sigmas[1])
    b, w = noise.shape[0], plan.trained_steps
    device = noise.device
    x = noise.float()
    step_fn = STEPS[plan.step]
    states, log_probs, levels, means = [x], [], [], []
    for j in range(plan.num_steps):
        in_window = ((j >= starts) & (j < starts + w)).float().to(device)
        level = plan.noise_level * in_window
        sigma = sigmas[j].to(device).expand(b)
        v = adapter.velocity(x, sigma, cond, neg, plan.guidance_scale)
        z = step_noise[j].to(device, non_blocking=True)
        out = step_fn(x, v, sigma, sigmas[j + 1].to(device).expand(b), level, sigma_1, noise=z)
        x = out.sample
        states.append(x)
        means.append(out.mean)
        log_probs.append(out.log_prob)
        levels.append(level)
    states_t = torch.stack(states, 1).cpu()  # (B, N+1, ...)
    lp_t, lv_t = torch.stack(log_probs, 1).cpu(), torch.stack(levels, 1).cpu()  # (B, N)
    pos = starts.view(-1, 1) + torch.arange(w + 1).view(1, -1)  # (B, W+1)
    win_latents = states_t[torch.arange(b).view(-1, 1), pos]
    win_sigmas = sigmas[pos]
    win_lp = torch.gather(lp_t, 1, pos[:, :w])
    win_levels = torch.gather(lv_t, 1, pos[:, :w])
    win_means = torch.stack(means, 1).cpu()[torch.arange(b).view(-1, 1), pos[:, :w]]
    return win_latents, win_lp, win_sigmas, win_levels, x.cpu(), win_means


def decode_images(adapter: GeneratorAdapter, latents: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Decode clean latents in chunks; images (B, 3, H, W) in [0, 1] on the CPU."""
    return torch.cat([adapter.decode(latents[i : i + batch_size].to(adapter.device)).cpu()
                      for i in range(0, latents.shape[0], batch_size)])


def rollout(
    adapter: GeneratorAdapter, prompts: list[str], metadata: list[dict], group_ids: torch.Tensor,
    plan: SamplingPlan, generator: torch.Generator, negative_prompt: str = "", initial_noise: torch.Tensor | None = None,
    decode: bool = True, step: int = 0, on_chunk=None,
) -> Rollout:
    """Sample len(prompts) trajectories in chunks of `plan.batch_size` and (optionally) decode them.

    `step` is the training step (it places `progressive` windows); with `plan.shared_noise` the samples of
    one group start from the same initial noise. `on_chunk(slice, final_latents)` is called as each chunk is
    sampled (the overlapped reward stage, rewards/stage.py, scores it while the next chunk samples).
    """
    device = adapter.device
    cond = adapter.encode_prompts(prompts)
    neg = adapter.encode_prompts([negative_prompt]) if plan.guidance_scale != 1.0 else None
    b = len(prompts)
    if initial_noise is None and plan.shared_noise:
        _, group_index = torch.unique(group_ids, return_inverse=True)
        per_group = [adapter.initial_noise(1, plan.height, plan.width, generator) for _ in range(int(group_index.max()) + 1)]
        initial_noise = torch.cat(per_group)[group_index.to(per_group[0].device)]
    elif initial_noise is None:
        initial_noise = torch.cat([adapter.initial_noise(1, plan.height, plan.width, generator) for _ in range(b)])
    starts = window_starts(plan, b, generator, step)
    # every sample's step noise is drawn up front, so `plan.batch_size` (a memory/speed knob) changes no number;
    # step-major, so a one-chunk rollout draws exactly what drawing step by step did (the README's measured runs)
    step_noise = torch.randn((plan.num_steps, b, *initial_noise.shape[1:]), generator=generator, dtype=torch.float32)
    parts = []
    for i in range(0, b, plan.batch_size):
        sl = slice(i, min(b, i + plan.batch_size))
        c = {k: v[sl] for k, v in cond.items()}
        n = None if neg is None else {k: v.expand(sl.stop - sl.start, *v.shape[1:]) for k, v in neg.items()}
        parts.append(sample_latents(adapter, c, n, initial_noise[sl].to(device), plan, starts[sl], step_noise[:, sl]))
        if on_chunk is not None:
            on_chunk(sl, parts[-1][4])  # the chunk's clean latents (sample_latents' 5th output)
    latents, log_probs, sigmas, levels, final, means = (torch.cat(t) for t in zip(*parts, strict=False))
    images = decode_images(adapter, final, plan.batch_size) if decode else None
    return Rollout(
        prompts=list(prompts), metadata=list(metadata), group_ids=group_ids,
        cond={k: v.cpu() for k, v in cond.items()}, neg=None if neg is None else {k: v.cpu() for k, v in neg.items()},
        latents=latents, log_probs=log_probs, sigmas=sigmas, noise_levels=levels, final=final, images=images,
        old_means=means,
    )
