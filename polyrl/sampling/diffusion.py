"""The rollout stage of a diffusion policy: sample trajectories with log-probs (docs/algorithms.md §1), decode each
chunk as soon as it is sampled, and hand the decoded media to the reward stage through a sink (a queue).

All randomness of a rollout is drawn up front by `draw_noise` from a `torch.Generator` the caller seeds per
training step, on the CPU in float32, for the whole global batch: a resumed run, a run with another
`rollout.batch_size` and a data-parallel rank (which takes its samples' rows) all see the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_map, tree_map_

from ..batch import Rollout
from ..latents import Latents, MediaShape, cat_latents, map_latents, stack_latents, to_device
from ..media import Audio, cat_media, cpu_media
from ..models.base import Cond, DiffusionPolicy, Guidance, Prompt, stream_sigma_1, stream_sigmas
from ..perf.profile import region
from ..perf.timer import StageTimer
from ..perf.transfer import host_copy, to_host
from .base import REFILL_STREAM, SAMPLERS, DrawAhead, step_generator
from .steps import STEPS, dpm2_latents, step_latents

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

    def select(self, idx: torch.Tensor | slice) -> RolloutNoise:
        """The draws of samples `idx`; a slice selects views (pinned memory stays pinned, nothing is copied)."""
        return RolloutNoise({k: v[idx] for k, v in self.initial.items()}, self.starts[idx],
                            {k: v[:, idx] for k, v in self.steps.items()})


def draw_noise(shapes: dict[str, tuple[int, ...]], plan: SamplingPlan, group_ids: torch.Tensor,
               generator: torch.Generator, step: int = 0, pin_memory: bool = False) -> RolloutNoise:
    """Draw a whole batch's randomness in a fixed order: initial noise sample by sample (or group by group with
    `plan.shared_noise`), window starts, then the step noise step-major, so the numbers depend on neither the
    chunking nor the rank that samples them. `pin_memory` (for a GPU rollout; the same numbers) puts the noise in
    page-locked memory, whose copies to the device the host queues without waiting."""
    def one() -> Latents:
        return {k: torch.randn((1, *s), generator=generator, dtype=torch.float32) for k, s in shapes.items()}

    b = len(group_ids)
    if plan.shared_noise:
        _, group_index = torch.unique(group_ids, return_inverse=True)
        per_group = cat_latents([one() for _ in range(int(group_index.max()) + 1)])
        initial = {k: v[group_index] for k, v in per_group.items()}
    else:
        initial = cat_latents([one() for _ in range(b)])
    if pin_memory:
        initial = {k: v.pin_memory() for k, v in initial.items()}
    starts = window_starts(plan, b, generator, step)
    steps = {k: torch.randn((plan.num_steps, b, *s), generator=generator, dtype=torch.float32, pin_memory=pin_memory)
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
    waits on an event recorded after them, so for everything queued on the stream before it too."""
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
    host = {k: Audio(host_copy(v.waveform, True), v.sample_rate) if isinstance(v, Audio) else host_copy(v, True)
            for k, v in decoded.items()}
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


class Sampled(NamedTuple):
    """One chunk's trajectories from `sample_latents`, on the sampling device (`sigmas` on the host)."""

    latents: Latents  # each (B, W+1, ...): the states of the trained window
    log_probs: torch.Tensor  # (B, W)
    sigmas: torch.Tensor  # (B, W+1)
    noise_levels: torch.Tensor  # (B, W)
    final: Latents  # each (B, ...): the clean latents
    means: Latents  # each (B, W, ...): the window's transition means


class Walk:
    """One chunk's way down the sigma grid: the step math, its noise and SDE window, and what the rollout keeps
    (the window's states, log-probs, levels and means). `sample_latents` asks the adapter for each step's velocity;
    an adapter that owns its sampling loop (`run_pipeline`, models/diffusers_pipeline.py) calls `step` itself."""

    def __init__(self, adapter: DiffusionPolicy, noise: RolloutNoise, plan: SamplingPlan):
        self.adapter, self.plan = adapter, plan
        self.sigmas = adapter.sigmas(plan.num_steps, plan.shape)
        self.sigma_1 = stream_sigma_1(adapter, self.sigmas)
        self.starts = noise.starts
        self.b, self.w = len(self.starts), plan.trained_steps
        device = self.device = adapter.device
        # every per-step input goes to the device once per chunk, each step's noise as its own (contiguous, so still
        # pinned) slice: a copy from pageable host memory makes the host wait for all the device's queued work
        self.x = to_device(noise.initial, device, torch.float32, non_blocking=True)
        self.grid = self.sigmas.to(device, non_blocking=True)
        self.starts_on = self.starts.to(device, non_blocking=True)
        self.step_noise = {k: [z.to(device, non_blocking=True) for z in s] for k, s in noise.steps.items()}
        self.step_fn = STEPS.get(plan.step)  # None for a multistep ODE solver (`dpm2`, `_dpm2`)
        self.x0_prev: Latents | None = None  # `dpm2`: the previous step's data prediction
        self.states, self.log_probs, self.levels, self.means = [self.x], [], [], []

    def sigma(self, j: int) -> torch.Tensor:
        return self.grid[j].expand(self.b)

    def trained(self) -> torch.Tensor:
        """(B, N) bool on the host: the steps each sample's SDE window covers (every step without a window)."""
        j = torch.arange(self.plan.num_steps).view(1, -1)
        start = self.starts.view(-1, 1)
        return (j >= start) & (j < start + self.w)

    def step(self, j: int, v: Latents) -> Latents:
        """Step j from the current state with velocity `v`; returns (and keeps) the next state."""
        level = self.plan.noise_level * ((j >= self.starts_on) & (j < self.starts_on + self.w)).float()
        sigma, sigma_next = self.grid[j].expand(self.b), self.grid[j + 1].expand(self.b)
        with region("step_math/rollout"):
            if self.step_fn is None:
                out = self._dpm2(j, v, sigma, sigma_next)
            else:
                z = {k: s[j] for k, s in self.step_noise.items()}
                out = step_latents(self.step_fn, self.x, v, stream_sigmas(self.adapter, sigma),
                                   stream_sigmas(self.adapter, sigma_next), level, self.sigma_1, noise=z,
                                   log_density=self.plan.log_density)
        self.x = out.sample
        self.states.append(self.x)
        self.means.append(out.mean)
        self.log_probs.append(out.log_prob)
        self.levels.append(level)
        return self.x

    def _dpm2(self, j: int, v: Latents, sigma: torch.Tensor, sigma_next: torch.Tensor):
        """Step j of the second-order multistep DPM-Solver++ (`rollout.step=dpm2`, steps.py `dpm2_step`): it reads
        step j − 1's data prediction and keeps this one's."""
        sigma_prev = None if j == 0 else stream_sigmas(self.adapter, self.grid[j - 1].expand(self.b))
        out, self.x0_prev = dpm2_latents(self.x, v, stream_sigmas(self.adapter, sigma),
                                         stream_sigmas(self.adapter, sigma_next), sigma_prev, self.x0_prev)
        return out

    def result(self) -> Sampled:
        # the window is gathered on the device: only its W+1 states (of N+1) will cross to the host
        b, w, device = self.b, self.w, self.device
        pos = self.starts.view(-1, 1) + torch.arange(w + 1).view(1, -1)  # (B, W+1)
        pos_on = self.starts_on.view(-1, 1) + torch.arange(w + 1, device=device).view(1, -1)
        rows_on = torch.arange(b, device=device).view(-1, 1)
        return Sampled(
            latents=map_latents(lambda t: t[rows_on, pos_on], stack_latents(self.states)),
            log_probs=torch.gather(torch.stack(self.log_probs, 1), 1, pos_on[:, :w]),
            sigmas=self.sigmas[pos],
            noise_levels=torch.gather(torch.stack(self.levels, 1), 1, pos_on[:, :w]),
            final=self.x,
            means=map_latents(lambda t: t[rows_on, pos_on[:, :w]], stack_latents(self.means)),
        )


@torch.no_grad()
def sample_latents(adapter: DiffusionPolicy, cond: Cond, shared: Cond, noise: RolloutNoise, plan: SamplingPlan) -> Sampled:
    """Run the sampler for one chunk. Nothing in it waits for the device: the results stay there (the caller
    copies them to the host, `rollout`), and the noise's copies to the device are queued without waiting (from
    pinned memory; see `draw_noise`).

    With `plan.training_graph` every step runs its network call `as_in_training` (the output detached): a compiled
    network then runs the graph training runs, not its no-grad eval-mode twin, whose fusions round differently
    (docs/performance.md, FP8 agreement), so the log-probs equal training's bit for bit when a sampling call and a
    training micro-batch have the same rows. The steps no sample trains run it too: the twin compiled for them alone
    (the last of flow_grpo's 10 steps) cost a cold start one more graph per block kind. It costs the training
    forward's activation memory, freed after each call."""
    walk = Walk(adapter, noise, plan)
    for j in range(plan.num_steps):
        x, sigma = walk.x, walk.sigma(j)
        if plan.training_graph:
            flops = adapter.flops
            with region("velocity/rollout"), as_in_training(adapter):
                v = {k: t.detach() for k, t in adapter.velocity(x, sigma, cond, shared, plan.guidance.scale).items()}
            adapter.flops -= (adapter.flops - flops) * 2 / 3  # counted as a trained forward (×3); no backward follows
        else:
            with region("velocity/rollout"):
                v = adapter.velocity(x, sigma, cond, shared, plan.guidance.scale)
        walk.step(j, v)
    return walk.result()


@torch.no_grad()
def sample_pipeline(adapter, prompts: list[Prompt], noise: RolloutNoise, plan: SamplingPlan,
                    decode: bool) -> tuple[Sampled, dict | None, list, float]:
    """One chunk from an adapter that owns its sampling loop (models/diffusers_pipeline.py): its
    `run_pipeline(prompts, initial, step, trained, plan, decode)` runs the loop and calls `step(j, v)` (`Walk`:
    the same step math, noise and window as `sample_latents`) with each step's velocity; it returns (decoded media
    or None, one record per sample of what training replays, decode seconds)."""
    walk = Walk(adapter, noise, plan)
    media, records, decode_s = adapter.run_pipeline(prompts, walk.x, walk.step, walk.trained(), plan, decode)
    return walk.result(), media, records, decode_s


def _host_like(value, pinned: bool, rows: int | None = None):
    """Empty host tensors shaped like each tensor of `value` (with `rows` samples when given); `pinned`: in
    page-locked memory, which a copy from the GPU can fill without the host waiting."""
    return tree_map(lambda t: torch.empty(t.shape if rows is None else (rows, *t.shape[1:]), dtype=t.dtype,
                                          pin_memory=pinned), value)


def _copy_rows(dst, src, rows: slice, pinned: bool) -> None:
    """Copy each tensor of `src` into rows `rows` of `dst`'s; into pinned memory the copy is only queued."""
    tree_map_(lambda d, s: d[rows].copy_(s, non_blocking=pinned), dst, src)


def _queued_work_done(device: torch.device) -> Callable[[], float]:
    """A `ready()` that waits for the work queued on `device` so far (an event recorded now; nothing on a CPU)."""
    if device.type != "cuda":
        return lambda: 0.0
    done = torch.cuda.Event()
    done.record()
    return lambda: done.synchronize() or 0.0


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
    # The results cross to the host without the host waiting: from a GPU each copy goes into pinned memory, queued
    # behind the chunk's sampling, and a chunk's `ready()` waits for an event recorded after its copies (one
    # stream), so the next chunk is launched while the device still samples this one. The host reads nothing
    # before `ready()`: the reward stage calls it per chunk, and this function for all chunks before it returns.
    pinned = adapter.device.type == "cuda"
    host_cond, host_shared = to_host(cond, pinned), to_host(shared, pinned)
    host, chunks = None, []
    # an adapter that runs its own sampling loop records per sample the network calls training replays (`extras`)
    owns_loop, replay = hasattr(adapter, "run_pipeline"), []
    for i in range(0, b, plan.batch_size):
        sl = slice(i, min(b, i + plan.batch_size))
        chunk_cond = {k: v[sl] for k, v in cond.items()}
        if owns_loop:
            part, media, records, decode_s = sample_pipeline(adapter, prompts[sl], noise.select(sl), plan, decode)
            replay += records
            media, ready = (None if media is None else cpu_media(media)), (lambda s=decode_s: s)
        else:
            part = sample_latents(adapter, chunk_cond, shared, noise.select(sl), plan)
        if host is None:
            host = _host_like(part, pinned, rows=b)
        _copy_rows(host, part, sl, pinned)
        if not owns_loop:
            media, ready = (decode_chunk(adapter, part.final, chunk_cond) if decode
                            else (None, _queued_work_done(adapter.device)))
        chunks.append(MediaChunk(sl, {k: v[sl] for k, v in host.final.items()}, media, ready))
        if sink is not None:
            sink.put(chunks[-1])
    decode_s = sum(c.ready() for c in chunks)
    if times is not None and decode:
        times["time/decode"] = times.get("time/decode", 0.0) + decode_s
    return Rollout(
        prompts=list(prompts), metadata=list(metadata), group_ids=group_ids, cond=host_cond, shared=host_shared,
        latents=host.latents, log_probs=host.log_probs, sigmas=host.sigmas, noise_levels=host.noise_levels,
        final=host.final, media=cat_media([c.media for c in chunks]) if decode else None, old_means=host.means,
        extras={"replay": replay} if owns_loop else {},
    )


def plan_from_config(r) -> SamplingPlan:
    """The `rollout.*` keys of a run's config as a SamplingPlan."""
    return SamplingPlan(
        num_steps=r.num_steps, shape=MediaShape(height=r.height, width=r.width, frames=r.num_frames, fps=r.fps),
        guidance=Guidance(r.guidance_scale, r.negative_prompt), noise_level=r.noise_level,
        window_size=r.sde_window_size, window_range=tuple(r.sde_window_range), batch_size=r.batch_size, step=r.step,
        window_strategy=r.sde_window_strategy, window_every=r.sde_window_every, shared_noise=r.shared_initial_noise,
        log_density=r.log_density, training_graph=r.training_graph,
    )


@SAMPLERS.register("diffusion")
class DiffusionSampler:
    """The training step's rollout stage for a diffusion policy (sampling/base.py `PolicySampler`): SDE
    trajectories with log-probs from noise drawn up front for the whole step (`draw_noise`), the next step's
    noise drawn on a worker thread while this step trains (`DrawAhead`). The rollout runs here on the actor's
    networks under `policy` (the actor's sampling policy), or on Ray rollout replicas (`use_remote`)."""

    fp8_auto = True  # measured on diffusion transformers (perf/fp8.py)
    runs_on_replicas = True  # Ray rollout replicas (distributed/ray_stages.py RolloutReplica)

    @staticmethod
    def plan_from_config(cfg, micro_batch: int, say) -> SamplingPlan:
        """The run's plan; `rollout.training_graph=auto` decided here (config/schema.py AUTO_SWITCH): on only where
        it is exact and costs no memory training does not already need, i.e. compiled networks and a sampling call
        of the training micro-batch's size (a bigger call would hold a bigger forward's activations)."""
        r = cfg.rollout
        compiled = cfg.model.get("compile", "none") != "none"
        if r.training_graph is True and r.batch_size != micro_batch:
            say(f"polyrl: warning: rollout.training_graph=true runs training's graph, but rollout.batch_size="
                f"{r.batch_size} against {micro_batch} samples per training micro-batch (actor.micro_batch_size) "
                "gives its calls other shapes, whose kernels may round differently and a bigger call holds more "
                "activations: set them equal for equal log-probs")
        if r.training_graph == "auto":
            r.training_graph = compiled and r.batch_size == micro_batch
        return plan_from_config(r)

    def __init__(self, adapter: DiffusionPolicy, plan: SamplingPlan, seed: int, reads_media: bool = True):
        self.adapter, self.plan, self.seed = adapter, plan, seed
        self.reads_media = reads_media  # decode the media (the reward reads them), else the latents alone
        self.latent_shapes = adapter.latent_shapes(plan.shape)  # a ValueError: a shape the model cannot make
        self.pinned = adapter.device.type == "cuda"
        self.policy = nullcontext  # the actor's sampling policy (the trainer sets it)
        self.sample = partial(rollout, adapter)
        self.remote = None
        self.ahead = DrawAhead()
        self.refill_generator: torch.Generator | None = None
        self.fps = plan.shape.fps  # of sample videos

    def use_remote(self, remote, max_staleness: int) -> None:
        """Sample on Ray rollout replicas, which hold the sampling policy's weights (trainer/remote.py), and with
        `rollout.max_staleness` = k > 0 start the next k steps' rollouts ahead (`prepare_next`)."""
        self.remote, self.sample, self.policy = remote, remote.rollout, nullcontext
        self.max_staleness = max_staleness

    def _draw(self, group_ids: torch.Tensor, mine: slice, step: int, generator: torch.Generator) -> RolloutNoise:
        return draw_noise(self.latent_shapes, self.plan, group_ids, generator, step,
                          pin_memory=self.pinned).select(mine)

    def draws(self, group_ids: torch.Tensor, mine: slice, step: int, attempt: int) -> RolloutNoise:
        if attempt == 0:
            key = (step, len(group_ids))
            return self.ahead.take(key, partial(self._draw, group_ids, mine, step, step_generator(self.seed, step)))
        if attempt == 1:  # refills draw from their own stream, one after the other
            self.refill_generator = step_generator(self.seed, step, REFILL_STREAM)
        return self._draw(group_ids, mine, step, self.refill_generator)

    def rollout(self, prompts: list, metadata: list[dict], group_ids: torch.Tensor, draws: RolloutNoise, sink,
                timer: StageTimer) -> Rollout:
        with timer("text_encode"):  # fills the model's prompt cache; the rollout then reads it
            self.adapter.encode_prompts(prompts)
            self.adapter.encode_guidance(self.plan.guidance)
        with timer("rollout"), self.policy():
            return self.sample(prompts, metadata, group_ids, self.plan, draws, decode=self.reads_media, sink=sink,
                               times=timer.times)

    def prepare_next(self, step: int, group_ids: torch.Tensor, mine: slice, max_steps: int, peek) -> None:
        """The next step's noise, drawn on a worker thread; with Ray rollout replicas and rollout.max_staleness = k,
        the next k steps' rollouts start now on the weights before this update (`peek(ahead)` gives the prompts
        and metadata of the step `ahead` steps on, without moving the data position)."""
        if self.remote is not None and self.max_staleness:
            for ahead in range(1, self.max_staleness + 1):
                if step + ahead >= max_steps:
                    break
                if ahead > len(self.remote.prefetched):  # not started by an earlier step
                    prompts, _ = peek(ahead)
                    noise = self.draws(group_ids, mine, step + ahead, 0)
                    self.remote.prefetch(prompts, self.plan, noise, self.reads_media)
        if step + 1 < max_steps:
            self.ahead.start((step + 1, len(group_ids)), partial(
                self._draw, group_ids, mine, step + 1, step_generator(self.seed, step + 1)))

    @torch.no_grad()
    def evaluate(self, prompts: list, metadata: list[dict], seed: int) -> Rollout:
        """Deterministic ODE samples from fixed noise (the same seeds at every evaluation)."""
        ode = replace(self.plan, noise_level=0.0, window_size=0)
        groups = torch.arange(len(prompts))
        noise = draw_noise(self.adapter.latent_shapes(ode.shape), ode, groups, step_generator(seed, 0))
        return rollout(self.adapter, list(prompts), list(metadata), groups, ode, noise)

    def metrics(self, batches: list[Rollout], engine) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.ahead.close()
