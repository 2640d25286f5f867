"""The rollout stage of a diffusion policy: sample trajectories with log-probs (docs/algorithms.md §1), decode each
chunk as soon as it is sampled, and hand the decoded media to the reward stage through a sink (a queue).

All randomness of a rollout is drawn up front by `draw_noise` from a `torch.Generator` the caller seeds per
training step, on the CPU in float32, for the whole global batch: a resumed run, a run with another
`rollout.batch_size` and a data-parallel rank (which takes its samples' rows) all see the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..batch import Rollout
from ..latents import Latents, MediaShape, cat_latents, map_latents, stack_latents, to_device
from ..media import Audio, cat_media, cpu_media
from ..models.base import Cond, DiffusionPolicy, Guidance, Prompt, stream_sigma_1, stream_sigmas
from ..perf.profile import region
from .steps import STEPS, step_latents

WINDOW_STRATEGIES = ("per_sample", "random", "progressive")


@dataclass
class SamplingPlan:
    """What a rollout samples. `window_size` 0 means every step is stochastic and trained."""

    num_steps: int
    shape: MediaShape
    guidance: Guidance
    noise_level: float
    window_size: int = 0
    window_range: tuple[int, int] = (0, 0)
    batch_size: int = 16  # samples per network call (memory bound)
    step: str = "sde"  # a name in sampling.steps.STEPS
    window_strategy: str = "per_sample"  # see window_starts
    window_every: int = 1  # `progressive`: training steps between slides
    shared_noise: bool = False  # one initial noise per prompt group (DanceGRPO)
    log_density: str = "gaussian"  # how a transition is scored: gaussian | squared_distance (steps.py)
    training_graph: bool = False  # trained steps through the training forward's graph (see `sample_latents`)

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


@dataclass
class RolloutNoise:
    """Every random draw of a rollout: initial latents (B, ...), window starts (B,), step noise (N, B, ...)."""

    initial: Latents
    starts: torch.Tensor
    steps: Latents

    def select(self, idx: torch.Tensor) -> RolloutNoise:
        return RolloutNoise({k: v[idx] for k, v in self.initial.items()}, self.starts[idx],
                            {k: v[:, idx] for k, v in self.steps.items()})


def draw_noise(shapes: dict[str, tuple[int, ...]], plan: SamplingPlan, group_ids: torch.Tensor,
               generator: torch.Generator, step: int = 0) -> RolloutNoise:
    """Draw a whole batch's randomness in a fixed order: initial noise sample by sample (or group by group with
    `plan.shared_noise`), window starts, then the step noise step-major, so the numbers depend on neither the
    chunking nor the rank that samples them."""
    def one() -> Latents:
        return {k: torch.randn((1, *s), generator=generator, dtype=torch.float32) for k, s in shapes.items()}

    b = len(group_ids)
    if plan.shared_noise:
        _, group_index = torch.unique(group_ids, return_inverse=True)
        per_group = cat_latents([one() for _ in range(int(group_index.max()) + 1)])
        initial = {k: v[group_index] for k, v in per_group.items()}
    else:
        initial = cat_latents([one() for _ in range(b)])
    starts = window_starts(plan, b, generator, step)
    steps = {k: torch.randn((plan.num_steps, b, *s), generator=generator, dtype=torch.float32)
             for k, s in shapes.items()}
    return RolloutNoise(initial, starts, steps)


@dataclass
class MediaChunk:
    """One sampled chunk on its way to the reward stage: samples `index` of the batch, their clean latents and
    decoded media (None when the reward reads latents only). On a GPU the media's copy to the host may still be
    in flight: `ready()` waits for it and returns the decode's seconds."""

    index: slice
    final: Latents
    media: dict | None
    ready: Callable[[], float] = field(default=lambda: 0.0)


@torch.no_grad()
def decode_chunk(adapter: DiffusionPolicy, final: Latents,
                 cond: Cond | None = None) -> tuple[dict, Callable[[], float]]:
    """Decode clean latents, through the adapter's `complete_latents` with the chunk's conditioning `cond` (a policy
    without that hook, or no `cond`, decodes them as they are); returns (media on the host, ready). On CUDA the decode
    and a pinned non-blocking copy are only queued (sampling of the next chunk is queued behind them), and `ready()`
    waits on an event."""
    dev = adapter.device

    def complete() -> Latents:
        latents = to_device(final, dev)
        hook = getattr(adapter, "complete_latents", None)
        return latents if hook is None or cond is None else hook(latents, to_device(cond, dev))

    if dev.type != "cuda":
        t0 = time.perf_counter()
        media = cpu_media(adapter.decode(complete()))  # an Audio's waveform too
        seconds = time.perf_counter() - t0
        return media, lambda: seconds
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decoded = adapter.decode(complete())
    end.record()
    host = {}
    for k, v in decoded.items():
        tensor = v.waveform if isinstance(v, Audio) else v
        host[k] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host[k].copy_(tensor, non_blocking=True)
        if isinstance(v, Audio):
            host[k] = Audio(host[k], v.sample_rate)
    copied = torch.cuda.Event()
    copied.record()

    def ready() -> float:
        copied.synchronize()
        return start.elapsed_time(end) / 1000

    return host, ready


@contextmanager
def as_in_training(adapter: DiffusionPolicy):
    """Autograd on and the networks in train mode, as the actor runs its forward: torch.compile specialises on both
    (a module's `training` flag is a guard), so only then does the rollout run training's compiled graph itself, not
    a twin compiled (and, on a GPU, autotuned) apart."""
    networks = [n for n in adapter.modules().values() if not n.training]
    for network in networks:
        network.train(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        for network in networks:
            network.train(False)


@torch.no_grad()
def sample_latents(adapter: DiffusionPolicy, cond: Cond, shared: Cond, noise: RolloutNoise, plan: SamplingPlan):
    """Run the sampler for one chunk; returns (window latents, log-probs, sigmas, noise levels, final latents,
    window means). Results stay on the device until the end, so the loop never waits for a device-to-host copy.

    With `plan.training_graph` every step runs its network call `as_in_training` (the output detached): a compiled
    network then runs the graph training runs, not its no-grad eval-mode twin, whose fusions round differently
    (docs/performance.md, FP8 agreement), so the log-probs equal training's bit for bit when a sampling call and a
    training micro-batch have the same rows. The steps no sample trains run it too: the twin compiled for them alone
    (the last of flow_grpo's 10 steps) cost a cold start one more graph per block kind. It costs the training
    forward's activation memory, freed after each call."""
    sigmas = adapter.sigmas(plan.num_steps, plan.shape)
    sigma_1 = stream_sigma_1(adapter, sigmas)
    starts = noise.starts
    b, w = len(starts), plan.trained_steps
    device = adapter.device
    x = to_device(noise.initial, device, torch.float32)
    # every per-step input goes to the device once per chunk: a copy from pageable host memory inside the loop makes
    # the host wait for the device at every step, and the device then idles while the next step is launched
    grid, starts_on, step_noise = sigmas.to(device), starts.to(device), to_device(noise.steps, device)
    step_fn = STEPS[plan.step]
    states, log_probs, levels, means = [x], [], [], []
    for j in range(plan.num_steps):
        level = plan.noise_level * ((j >= starts_on) & (j < starts_on + w)).float()
        sigma, sigma_next = grid[j].expand(b), grid[j + 1].expand(b)
        if plan.training_graph:
            flops = adapter.flops
            with region("velocity/rollout"), as_in_training(adapter):
                v = {k: t.detach() for k, t in adapter.velocity(x, sigma, cond, shared, plan.guidance.scale).items()}
            adapter.flops -= (adapter.flops - flops) * 2 / 3  # counted as a trained forward (×3); no backward follows
        else:
            with region("velocity/rollout"):
                v = adapter.velocity(x, sigma, cond, shared, plan.guidance.scale)
        with region("step_math/rollout"):
            z = {k: s[j] for k, s in step_noise.items()}
            out = step_latents(step_fn, x, v, stream_sigmas(adapter, sigma), stream_sigmas(adapter, sigma_next),
                               level, sigma_1, noise=z, log_density=plan.log_density)
        x = out.sample
        states.append(x)
        means.append(out.mean)
        log_probs.append(out.log_prob)
        levels.append(level)
    lp_t, lv_t = torch.stack(log_probs, 1).cpu(), torch.stack(levels, 1).cpu()  # (B, N)
    pos = starts.view(-1, 1) + torch.arange(w + 1).view(1, -1)  # (B, W+1)
    rows = torch.arange(b).view(-1, 1)
    # the window is gathered on the device: only its W+1 states (of N+1) cross to the host
    rows_on, pos_on = rows.to(device), pos.to(device)
    win_latents = map_latents(lambda t: t[rows_on, pos_on].cpu(), stack_latents(states))  # (B, W+1, ...)
    win_means = map_latents(lambda t: t[rows_on, pos_on[:, :w]].cpu(), stack_latents(means))
    win_lp = torch.gather(lp_t, 1, pos[:, :w])
    win_levels = torch.gather(lv_t, 1, pos[:, :w])
    return win_latents, win_lp, sigmas[pos], win_levels, {k: v.cpu() for k, v in x.items()}, win_means


def rollout(
    adapter: DiffusionPolicy, prompts: list[Prompt], metadata: list[dict], group_ids: torch.Tensor,
    plan: SamplingPlan, noise: RolloutNoise, decode: bool = True, sink=None, times: dict | None = None,
) -> Rollout:
    """Sample len(prompts) trajectories in chunks of `plan.batch_size`, decoding each chunk after it is sampled.

    `noise` holds this batch's draws (`draw_noise`, or its rows for this rank). Each chunk goes to `sink.put(
    MediaChunk)` as soon as it is sampled (the reward stage scores it while the next chunk samples); the
    returned batch holds every chunk's media too. `times["time/decode"]` accumulates the decode seconds.
    """
    cond = adapter.encode_prompts(prompts)
    shared = adapter.encode_guidance(plan.guidance)
    b = len(prompts)
    parts, chunks = [], []
    for i in range(0, b, plan.batch_size):
        sl = slice(i, min(b, i + plan.batch_size))
        idx = torch.arange(sl.start, sl.stop)
        chunk_cond = {k: v[sl] for k, v in cond.items()}
        parts.append(sample_latents(adapter, chunk_cond, shared, noise.select(idx), plan))
        final = parts[-1][4]
        media, ready = decode_chunk(adapter, final, chunk_cond) if decode else (None, lambda: 0.0)
        chunks.append(MediaChunk(sl, final, media, ready))
        if sink is not None:
            sink.put(chunks[-1])
    decode_s = sum(c.ready() for c in chunks)
    if times is not None and decode:
        times["time/decode"] = times.get("time/decode", 0.0) + decode_s
    latents, log_probs, sigmas, levels, final, means = (
        cat_latents(list(t)) if isinstance(t[0], dict) else torch.cat(t) for t in zip(*parts, strict=True))
    return Rollout(
        prompts=list(prompts), metadata=list(metadata), group_ids=group_ids,
        cond={k: v.cpu() for k, v in cond.items()}, shared={k: v.cpu() for k, v in shared.items()},
        latents=latents, log_probs=log_probs, sigmas=sigmas, noise_levels=levels, final=final,
        media=cat_media([c.media for c in chunks]) if decode else None, old_means=means,
    )
