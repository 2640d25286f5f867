"""The training loop: prompts → rollout → reward → advantage → update, with eval, logging and checkpoints.

It holds no model or algorithm special case: those live behind the model, reward, algorithm and actor
registries, built from the config. It dispatches on the model's policy kind only (models/base.py: a diffusion
policy's stages are here, a token policy's in trainer/tokens.py: its sampler, actor, pairs and held-out samples).
It holds no rank logic beyond asking the engine for this rank's share of the
step's prompt groups, gathering the step's rewards, and letting only rank 0 write (distributed/engine.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ..actor import actor_class
from ..actor.local import micro_batch_samples
from ..actor.tokens import TokenActor
from ..algorithms import build_algorithm, compute_advantages
from ..algorithms.advantage import zero_std_ratio
from ..batch import Rollout
from ..config.schema import ConfigError
from ..data.pairs import load_pairs, pair_batch
from ..data.prompts import MissingConditionImage, PromptSampler, load_prompts, row_location, split_row
from ..data.text_pairs import load_text_pairs
from ..distributed.dims import SHARDED_BACKENDS
from ..distributed.engine import LocalEngine, build_engine
from ..errors import UserError
from ..latents import MediaShape
from ..models import MODELS, build_model
from ..models.base import Guidance, policy_kind
from ..perf.compile import compile_cache_path, compile_transformer, load_compile_cache, save_compile_cache
from ..perf.fp8 import apply_fp8, resolve_fp8
from ..perf.timer import StageTimer
from ..perf.transfer import host_copy
from ..rewards import build_reward
from ..rewards.stage import RewardStage, RewardUnavailable, merge_extras, score_batch
from ..sampling.diffusion import SamplingPlan, draw_noise, rollout
from .checkpoint import (
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    checkpoint_step,
    clean_stale,
    list_checkpoints,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)
from .logging import MetricsLogger, pick_tiles, plot_reward_curve, save_samples
from .tokens import evaluate_tokens, save_text_samples, token_pair_batch, token_plan_from_config, token_step


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The RNG of one (step, purpose): independent of everything before it, so resume is exact."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 16 + stream)


def plan_from_config(r: DictConfig) -> SamplingPlan:
    return SamplingPlan(
        num_steps=r.num_steps, shape=MediaShape(height=r.height, width=r.width, frames=r.num_frames, fps=r.fps),
        guidance=Guidance(r.guidance_scale, r.negative_prompt), noise_level=r.noise_level,
        window_size=r.sde_window_size, window_range=tuple(r.sde_window_range), batch_size=r.batch_size, step=r.step,
        window_strategy=r.sde_window_strategy, window_every=r.sde_window_every, shared_noise=r.shared_initial_noise,
        log_density=r.log_density, training_graph=r.training_graph,
    )


def resolve_run_dir(cfg: DictConfig) -> tuple[Path, list[Path], list[str]]:
    """(run directory, checkpoints to resume from (newest first; empty: a fresh start), lines to tell the user).

    `trainer.resume=auto` continues `trainer.output_dir`, or else the newest run of `runs/<name>/`; when that newest
    run has no checkpoint but an older one has, which one is meant is ambiguous and it refuses, naming the runs.
    Leftovers of an interrupted checkpoint write in the chosen run are cleaned first (`clean_stale`).
    """
    t = cfg.trainer
    if t.resume not in (None, "auto"):
        ckpt = Path(t.resume)
        if not (ckpt / STATE_FILE).is_file():
            raise CheckpointError(f"trainer.resume={t.resume!r} is not a checkpoint directory (no {STATE_FILE})")
        checkpoint_step(ckpt)
        return ckpt.parent.parent, [ckpt], []
    if t.output_dir is not None:
        run_dir = Path(t.output_dir)
        notes = [f"polyrl: {line}" for line in clean_stale(run_dir)]
        found = list_checkpoints(run_dir)
        if found and t.resume is None:
            raise FileExistsError(
                f"trainer.output_dir={str(run_dir)!r} already holds a run; pass trainer.resume=auto to continue it, "
                "or choose another trainer.output_dir"
            )
        if t.resume == "auto" and not found:
            notes.append(f"polyrl: trainer.resume=auto: {run_dir} has no checkpoint yet; starting at step 0")
        return run_dir, found, notes
    root = Path("runs") / cfg.name
    runs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    notes = []
    if t.resume == "auto":
        if runs:
            newest = runs[-1]
            notes = [f"polyrl: {line}" for line in clean_stale(newest)]
            found = list_checkpoints(newest)
            if found:
                return newest, found, notes
            older = [(r, list_checkpoints(r)) for r in runs[:-1]]
            older = [f"{r} (step {checkpoint_step(c[0])})" for r, c in older if c]
            if older:
                raise UserError(
                    f"trainer.resume=auto is ambiguous: the newest run of {cfg.name}, {newest}, has no checkpoint "
                    f"(it stopped before its first save, or is still running), but older runs have: "
                    f"{', '.join(older[::-1])}. Continue one with trainer.output_dir=<run> trainer.resume=auto, "
                    f"or start afresh without trainer.resume"
                )
        notes.append(f"polyrl: trainer.resume=auto: no run of {cfg.name} under {root} has a checkpoint; "
                     "starting a new run")
    return root / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), [], notes


def resolve_on_main(engine: LocalEngine, cfg: DictConfig) -> tuple[Path, list[Path], list[str]]:
    """Rank 0 resolves the run directory (its clock names a new run) and every rank uses its answer or error."""
    answer = None
    if engine.is_main:
        try:
            answer = resolve_run_dir(cfg)
        except (UserError, FileNotFoundError, FileExistsError) as e:
            answer = e
    answer = engine.broadcast_object(answer)
    if isinstance(answer, Exception):
        raise answer
    return answer


def resume_command(overrides: list[str], run_dir: Path) -> str:
    """The command that continues this run: the same overrides, pinned to its directory, trainer.resume=auto."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("trainer.resume=", "trainer.output_dir="))]
    args = keep + [f"trainer.output_dir={run_dir}", "trainer.resume=auto"]
    return "polyrl train " + " ".join(shlex.quote(a) for a in args)


def set_determinism(deterministic: bool) -> None:
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


@torch.no_grad()
def evaluate(adapter, reward, cfg: DictConfig, rows: list[dict], plan: SamplingPlan, n: int | None = None):
    """Held-out reward: deterministic ODE sampling from fixed noise (the same seeds at every evaluation)."""
    n = n or cfg.trainer.eval_samples
    picked = [rows[i % len(rows)] for i in range(n)]
    prompts, metadata = zip(*(split_row(r) for r in picked), strict=True)
    ode = replace(plan, noise_level=0.0, window_size=0)
    groups = torch.arange(n)
    noise = draw_noise(adapter.latent_shapes(ode.shape), ode, groups, step_generator(cfg.trainer.eval_seed, 0))
    batch = rollout(adapter, list(prompts), list(metadata), groups, ode, noise)
    score_batch(reward, cfg.reward.name, batch)
    return float(batch.rewards.mean()), batch


def reward_metrics(parts: list[tuple[int, dict]]) -> dict[str, float]:
    """Mean of each reward extra over the finite values of every rank's samples (`(samples, extras)` per rank)."""
    out = {}
    for k, v in merge_extras(parts).items():
        vals = [float(x) for x in v if x is not None and not (isinstance(x, float) and math.isnan(x))]
        if vals:
            # per-component scores of a mix are logged under their own name (reward/<component>)
            out[k if k.startswith("reward/") else f"reward_extra/{k}"] = sum(vals) / len(vals)
    return out


SNAPSHOT_MAX_PARAMS = 2**25  # trainable elements copied to the CPU before each update (see WeightSnapshot)


class WeightSnapshot:
    """The actor's trainable state before an update (weights, optimizer, EMA / old copy, update count) on the CPU:
    a step that fails or is abandoned in the middle of its update is rolled back to it, so the last completed
    step can still be saved. Taken only while the trainable weights have at most SNAPSHOT_MAX_PARAMS elements
    (every LoRA we train; a full fine-tune of a large model is not copied every step).

    From a GPU the tensors are copied into pinned memory without waiting: a copy into pageable memory makes the
    host wait for the device once per tensor (1,544 waits per update for SD3's LoRA with AdamW and EMA). The copies
    are queued before the update's kernels on the same stream, so they read the weights as they were; `restore`
    waits for them."""

    def __init__(self, actor):
        self.params = [_host_copy(p) for p in actor.params]
        self.optimizer = _to_cpu(actor.optimizer.state_dict())
        old = getattr(actor, "old_params", None)
        self.old = None if old is None else [_host_copy(o) for o in old]
        self.updates = actor.num_updates
        devices = {p.device for p in actor.params if p.device.type == "cuda"}
        self.copied = [torch.cuda.current_stream(d).record_event() for d in devices]

    @staticmethod
    def fits(actor) -> bool:
        return sum(p.numel() for p in actor.params) <= SNAPSHOT_MAX_PARAMS

    @torch.no_grad()
    def restore(self, actor) -> None:
        for event in self.copied:
            event.synchronize()
        for p, saved in zip(actor.params, self.params, strict=True):
            p.copy_(saved)
        actor.optimizer.load_state_dict(self.optimizer)
        if self.old is not None:
            for o, saved in zip(actor.old_params, self.old, strict=True):
                o.copy_(saved)
        actor.num_updates = self.updates


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` on the CPU; a plain CUDA tensor goes to pinned memory without waiting for the device (the
    caller records an event after the copies). A sharded (DTensor) parameter is copied as it is."""
    tensor = tensor.detach()
    return host_copy(tensor, pinned=tensor.device.type == "cuda" and type(tensor) is torch.Tensor)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class NoiseAhead:
    """The next step's rollout noise, drawn on a worker thread while this step trains. The draw is CPU work (the
    SD3.5-M benchmark's 64 samples x 11 latents of 16x64x64 are 46 M normals, ~0.3 s) that the GPU would otherwise
    wait for at the start of every step. Same generator, same numbers as a draw in place; a draw for another key
    (the step after a stop, a changed batch) is discarded and drawn again."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-noise")
        self.pending: tuple[tuple, Future] | None = None

    def start(self, key: tuple, draw) -> None:
        self.discard()
        self.pending = (key, self.pool.submit(draw))

    def take(self, key: tuple, draw):
        """The noise for `key`: the one drawn ahead, else `draw()` now."""
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


class StopRequested(BaseException):
    """Raised by the SIGINT / SIGTERM handler to abandon the work in progress (like KeyboardInterrupt, it is not an
    Exception, so no library `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunStopped(UserError):
    """The run stopped on a signal after saving its last completed step; `exit_code` is 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class Trainer:
    def __init__(self, cfg: DictConfig, overrides: list[str] | None = None):
        self.cfg = cfg
        self.overrides = list(overrides or [])  # for the resume command printed when a run stops
        t = cfg.trainer
        if t.device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"trainer.device=cuda but torch {torch.__version__} sees no CUDA device "
                            f"({'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); "
                            "use trainer.device=cpu (or auto)")
        self.engine = build_engine(t.device, cfg)
        self.say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if self.engine.is_main else (lambda msg: None)
        if cfg.data.prompts_per_step % self.engine.dp_size:
            raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the number of "
                              f"data-parallel ranks ({self.engine.dp_size})")
        self.run_dir, candidates, notes = resolve_on_main(self.engine, cfg)
        for note in notes:
            self.say(note)
        set_determinism(t.deterministic)
        torch.manual_seed(t.seed)
        self.device = self.engine.device
        # Everything that can fail on a bad config, bad data or an absent service fails here, before the model loads.
        self.reward = build_reward(OmegaConf.to_container(cfg.reward))
        if hasattr(self.reward, "preflight"):  # e.g. reward=http: the server answers /health
            self.reward.preflight()
        self.reward_stage = RewardStage(self.reward, cfg.reward.name, overlap=bool(cfg.reward.get("async", False)))
        self.algo = build_algorithm(OmegaConf.to_container(cfg.algorithm))
        # Offline pairs (data.pairs_path) replace the prompts: each step trains on a batch of pairs, no rollout.
        self.kind = policy_kind(MODELS.get(cfg.model.name))  # "diffusion" | "tokens": which stages run
        # switches whose `auto` default depends on this run (config/schema.py AUTO_SWITCH), decided once, here; the
        # run's config.yaml records the outcome. FP8's auto is measured on diffusion transformers only.
        graph_asked = cfg.rollout.training_graph is True
        cfg.model.fp8 = (resolve_fp8(cfg.model.fp8, self.device, lora=cfg.actor.lora_rank > 0,
                                     sharded=cfg.actor.backend in SHARDED_BACKENDS, dtype=cfg.model.dtype)
                         if self.kind == "diffusion" else cfg.model.fp8 is True)
        try:
            loader = load_text_pairs if self.kind == "tokens" else load_pairs
            self.pairs = loader(cfg.data.pairs_path) if cfg.data.pairs_path else None
        except ValueError as e:  # bad rows, each named by line
            raise UserError(str(e)) from None
        # a model conditioned on images (model class attribute `condition_images`: a bool, or a function of
        # model.options for a model whose modes differ) refuses a row without one
        needs_images = getattr(MODELS.get(cfg.model.name), "condition_images", False)
        needs_images = bool(needs_images(cfg.model.options) if callable(needs_images) else needs_images)
        try:
            prompts = None if self.pairs else load_prompts(cfg.data.path, require_image=needs_images)
            self.heldout = (load_prompts(cfg.data.heldout_path, require_image=needs_images)
                            if cfg.data.heldout_path else None)
        except MissingConditionImage as e:
            raise ConfigError(f"{e}; model.name={cfg.model.name} needs a condition image in every row") from None
        except ValueError as e:  # the data file's own problems, each message names the file (and line)
            raise UserError(str(e)) from None
        for path, rows in ((cfg.data.path, prompts), (cfg.data.heldout_path, self.heldout)):
            self._check_rows(path, rows)
        self.sampler = PromptSampler(self.pairs or prompts, t.seed, cfg.data.shuffle)
        self.compile_cache = compile_cache_path(cfg.model.get("compile_cache"), self.run_dir)
        self.compiled = cfg.model.get("compile", "none") != "none"
        r, a = cfg.rollout, cfg.actor
        micro = micro_batch_samples(a.micro_batch_size, cfg.data.prompts_per_step * r.n // max(a.num_minibatches, 1)
                                    // self.engine.dp_size)  # the actor's, before zero-advantage groups are dropped
        if r.training_graph == "auto":
            # only where it is exact and costs no memory training does not already need: a sampling call of the
            # micro-batch's size (a bigger call would hold a bigger forward's activations)
            r.training_graph = self.compiled and r.batch_size == micro
        if graph_asked and r.batch_size != micro:
            self.say(f"polyrl: warning: rollout.training_graph=true runs training's graph, but rollout.batch_size="
                     f"{r.batch_size} against {micro} samples per training micro-batch (actor.micro_batch_size) gives "
                     "its calls other shapes, whose kernels may round differently and a bigger call holds more "
                     "activations: set them equal for equal log-probs")
        self.plan = token_plan_from_config(cfg.rollout) if self.kind == "tokens" else plan_from_config(cfg.rollout)
        if self.compiled:
            try:  # before anything compiled runs (the SD3 VAE decoder too)
                loaded = load_compile_cache(self.compile_cache)
            except ValueError as e:  # costs only time: the graphs compile as without a cache
                self.say(f"polyrl: warning: compile cache not loaded: {e}; compiling from scratch")
                loaded = 0
            if loaded:
                self.say(f"polyrl: compile cache: loaded {loaded / 2**20:.1f} MiB from {self.compile_cache}")
            else:  # a cold first step can take minutes (docs/performance.md): say why it is slow, and what helps
                saved = (f"saved to {self.compile_cache} after it (point model.compile_cache at that file to start "
                         "warm)" if self.compile_cache else "not saved (model.compile_cache=null)")
                self.say(f"polyrl: model.compile={cfg.model.compile}: the first step also compiles the networks "
                         f"(minutes unless torch's own cache holds them); the graphs are {saved}")
        self.adapter = build_model(cfg.model, self.device)
        try:  # a media shape the model cannot make is a config error, reported before anything runs
            self.latent_shapes = self.adapter.latent_shapes(self.plan.shape) if self.kind == "diffusion" else {}
        except ValueError as e:
            raise ConfigError(str(e)) from None
        actor = TokenActor if self.kind == "tokens" else actor_class(cfg.actor.backend)
        self.actor = actor(self.adapter, cfg.actor, self.plan, self.algo, cfg.rollout_correction, self.engine)
        for network in self.adapter.modules().values():
            if cfg.model.fp8:
                apply_fp8(network)  # after LoRA: only the frozen base layers are swapped
            compile_transformer(network, cfg.model.compile)  # after LoRA, so the graph includes it
        self.step = 0
        if candidates:
            if t.resume == "auto":  # the newest usable checkpoint, saying which were skipped
                loaded, state = load_newest(candidates, self.actor, self.sampler, self.say)
            else:  # the one named: no fallback
                loaded, state = candidates[0], load_checkpoint(candidates[0], self.actor, self.sampler)
            self.step = state["step"]
            self.say(f"polyrl: resuming run {self.run_dir} from {loaded.name} (step {self.step})"
                     + (" instead" if loaded != candidates[0] else ""))
        self.logger = None
        if self.engine.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            self.logger = MetricsLogger(self.run_dir, self._loggers(), cfg.name,
                                        OmegaConf.to_container(cfg, resolve=True), warn=self.say)
            if candidates:
                note = self.logger.truncate_after(self.step)
                if note:
                    self.say(f"polyrl: {note}")
        self.saved_step = self.step if candidates else None  # the step of the newest checkpoint on disk
        self._stop: int | None = None  # the signal that asked the run to stop
        self._phase = "idle"  # step (nothing trained yet) | update | eval | save | idle
        self._snapshot: WeightSnapshot | None = None
        self.noise_ahead = NoiseAhead()
        self._sampler_before: dict | None = None
        self._pending: dict | None = None  # a completed step's metrics not yet logged
        self._stop_note = ""
        self._tiles: dict | None = None
        self.bar = tqdm(disable=True)  # fit's progress bar
        # the rollout stage: in this process on the actor's networks, or on Ray rollout replicas (docs/ray.md)
        self.sample = partial(rollout, self.adapter)
        self.rollout_policy = self.actor.sampling_policy
        self.remote = None
        if t.launcher == "ray":
            self._launch_ray()

    def _launch_ray(self) -> None:
        """Worker groups on Ray: reward workers, and rollout replicas when rollout.workers > 0; they replace the
        local stages behind the same calls (`reward_stage.begin`, `sample`), and get the weights after updates."""
        if self.engine.world_size > 1:
            raise ConfigError("trainer.launcher=ray runs one driver process; start it with `polyrl train`, not torchrun")
        if self.kind != "diffusion":
            raise ConfigError(f"trainer.launcher=ray drives diffusion policies; model.name={self.cfg.model.name} is a "
                              f"{self.kind} policy: use trainer.launcher=local")
        from .remote import launch  # Ray is imported only by a run that asks for it

        self.remote = launch(self.cfg, self.actor, self.adapter, self.reward_stage.reads_media)
        if self.remote.reward_stage is not None:
            self.reward_stage.close()
            self.reward_stage = self.remote.reward_stage
        if self.remote.rollout is not None:  # the replicas hold the sampling policy's weights (remote.py)
            self.sample, self.rollout_policy = self.remote.rollout.rollout, nullcontext

    def _loggers(self) -> list[str]:
        t = self.cfg.trainer
        return [name for name in t.loggers if t.tensorboard or name != "tensorboard"]

    def _check_rows(self, path, rows: list[dict] | None) -> None:
        """Every data row is one the reward can score (rewards that can tell define `check_prompt`)."""
        check = getattr(self.reward, "check_prompt", None)
        if check is None or rows is None:
            return
        for i, row in enumerate(rows):
            prompt, meta = split_row(row)
            try:
                check(prompt if isinstance(prompt, str) else prompt["text"], meta)
            except ValueError as e:
                raise UserError(f"{row_location(path, i)}: {e}") from None

    # ------------------------------------------------------------------------------------------- stages
    def score(self, batch: Rollout) -> None:
        score_batch(self.reward, self.cfg.reward.name, batch)

    def local_rows(self, rows: list) -> list:
        """This rank's contiguous share of the step's rows (prompt groups or pairs)."""
        share = self.engine.shard(len(rows))
        return rows[share.start:share.stop]

    def pair_step(self) -> dict:
        """One update on a batch of offline preference pairs (data.pairs_path): encode, then the actor's update."""
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        rows = self.local_rows(self.sampler.next(cfg.data.prompts_per_step))
        batch = (token_pair_batch(self.adapter, rows) if self.kind == "tokens"
                 else pair_batch(self.adapter, rows, cfg.rollout.height, cfg.rollout.width))
        t1 = time.perf_counter()
        stats = self._update(batch, step_generator(cfg.trainer.seed, step, stream=1))
        t2 = time.perf_counter()
        return {"step": step + 1, **stats, "lr": self.actor.optimizer.param_groups[0]["lr"],
                "time/encode": t1 - t0, "time/train": t2 - t1, "time/step": t2 - t0}

    def train_step(self) -> dict:
        cfg, step, engine = self.cfg, self.step, self.engine
        if self.pairs is not None:
            return self.pair_step()
        if self.kind == "tokens":
            return token_step(self)
        timer = StageTimer(self.device)
        flops_before = getattr(self.adapter, "flops", 0.0)
        with timer("step"):
            rows = self.sampler.next(cfg.data.prompts_per_step)  # the global step: every rank draws the same rows
            prompts, metadata, group_ids, mine, noise = self._step_inputs(rows, step)
            with timer("text_encode"):  # fills the model's prompt cache; the rollout then reads it
                self.adapter.encode_prompts(prompts)
                self.adapter.encode_guidance(self.plan.guidance)
            # reward: after the rollout, or chunk by chunk during it (reward.async, rewards/stage.py)
            scoring = self.reward_stage.begin(prompts, metadata)
            try:
                with timer("rollout"), self.rollout_policy():
                    batch = self.sample(prompts, metadata, group_ids[mine], self.plan, noise,
                                        decode=self.reward_stage.reads_media, sink=scoring, times=timer.times)
            except BaseException:
                scoring.cancel()
                raise
            scoring.finish(batch, timer)
            del noise  # freed before the next step's is drawn (a video run's noise is gigabytes on the host)
            rewards = engine.gather(batch.rewards)  # the step's rewards, in global sample order
            advantages = compute_advantages(self.algo, rewards, group_ids)
            batch.advantages = advantages[mine]
            if cfg.rollout.max_staleness:
                self._prefetch(step)
            if step + 1 < cfg.trainer.max_steps:  # drawn on a worker thread while this step trains
                self.noise_ahead.start((step + 1, len(rows)), partial(self._draw_noise, len(rows), step + 1))
            with timer("train"):
                stats = self._update(batch, step_generator(cfg.trainer.seed, step, stream=1))
            if self.remote is not None:
                with timer("weight_sync"):
                    stats.update(self.remote.sync())
        timings = timer.times
        step_flops = float(engine.sum(torch.tensor(getattr(self.adapter, "flops", 0.0) - flops_before,
                                                   dtype=torch.float64, device=engine.device)))
        if step_flops > 0:
            timings["perf/tflops"] = step_flops / 1e12
            timings["perf/achieved_tflops_per_s"] = step_flops / 1e12 / timings["time/step"]
            if cfg.trainer.peak_tflops:
                gpus = engine.world_size + (self.remote.gpus if self.remote is not None else 0.0)
                timings["perf/mfu"] = timings["perf/achieved_tflops_per_s"] / (cfg.trainer.peak_tflops * gpus)
        return {
            "step": step + 1,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "zero_std_ratio": zero_std_ratio(rewards, group_ids),
            "adv/abs_mean": float(advantages.abs().mean()),
            **stats,
            "lr": self.actor.optimizer.param_groups[0]["lr"],
            **timings,
            **reward_metrics(engine.gather_objects((len(batch), batch.reward_extras))),
        }

    def _step_inputs(self, rows: list, step: int):
        """(prompts, metadata, group ids, this rank's sample indices, noise) of a step's rows: every prompt n times,
        the whole step's draws, then this rank's rows (the numbers do not depend on the world size)."""
        n = self.cfg.rollout.n
        group_ids, mine = self._sample_ids(len(rows))
        share = self.engine.shard(len(rows))
        prompts, metadata = [], []
        for row in rows[share.start:share.stop]:
            prompt, meta = split_row(row)
            prompts += [prompt] * n
            metadata += [meta] * n
        noise = self.noise_ahead.take((step, len(rows)), partial(self._draw_noise, len(rows), step))
        return prompts, metadata, group_ids, mine, noise

    def _sample_ids(self, rows: int) -> tuple[torch.Tensor, slice]:
        """(group id of every sample of the step, this rank's samples: whole groups, contiguous)."""
        n = self.cfg.rollout.n
        share = self.engine.shard(rows)
        return torch.arange(rows).repeat_interleave(n), slice(share.start * n, share.stop * n)

    def _draw_noise(self, rows: int, step: int):
        group_ids, mine = self._sample_ids(rows)
        return draw_noise(self.latent_shapes, self.plan, group_ids, step_generator(self.cfg.trainer.seed, step),
                          step, pin_memory=self.device.type == "cuda").select(mine)

    def _prefetch(self, step: int) -> None:
        """rollout.max_staleness = k: the rollout replicas start the next k steps' rollouts now, on the weights
        before this update (their staleness is logged as rollout/staleness). The sampler is only peeked: a
        checkpoint of this step resumes at the next step's rows."""
        remote, k = self.remote.rollout, self.cfg.rollout.max_staleness
        before = self.sampler.state_dict()
        try:
            for ahead in range(1, k + 1):
                rows = self.sampler.next(self.cfg.data.prompts_per_step)
                if step + ahead >= self.cfg.trainer.max_steps:
                    break
                if ahead > len(remote.prefetched):  # not started by an earlier step
                    prompts, _, _, _, noise = self._step_inputs(rows, step + ahead)
                    remote.prefetch(prompts, self.plan, noise, self.reward_stage.reads_media)
        finally:
            self.sampler.load_state_dict(before)

    def _update(self, batch: Rollout, generator: torch.Generator) -> dict:
        """The actor's update, after a copy of what it changes (WeightSnapshot) where that copy is small."""
        # the last snapshot goes first: its pinned buffers then serve this one (the host allocator caches them)
        self._snapshot = None
        self._snapshot = WeightSnapshot(self.actor) if WeightSnapshot.fits(self.actor) else None
        self._phase = "update"
        return self.actor.update(self.algo, batch, generator)

    # ------------------------------------------------------------------------------------------- eval
    def evaluate(self, n: int | None = None) -> tuple[float, Rollout]:
        rows = self.heldout or self.sampler.rows
        if self.kind == "tokens":
            return evaluate_tokens(self.adapter, self.reward, self.cfg, rows, self.plan, n)
        return evaluate(self.adapter, self.reward, self.cfg, rows, self.plan, n)

    def _eval_and_grid(self, metrics: dict) -> None:
        """Held-out evaluation and the sample grid (rank 0; the other ranks wait at the next collective, or evaluate
        too when the weights are sharded: each forward needs every rank). A stop signal abandons it at once (the
        step it follows is complete)."""
        if not (self.engine.is_main or self.engine.sharded):
            return
        self._phase = "eval"
        self.bar.set_description_str(f"{self.cfg.name} (evaluating {self.cfg.trainer.eval_samples} held-out samples)")
        self.bar.refresh()
        t0 = time.perf_counter()
        try:
            mean, batch = self.evaluate()
            if not self.engine.is_main:  # rank 0 writes
                return
            if self.kind == "tokens":  # every held-out response, as text
                save_text_samples(batch, self.run_dir / "samples" / f"step_{self.step:06d}.jsonl")
            elif self.cfg.trainer.num_validation > 0:
                tiles, baselines = self._grid_tiles(batch)
                save_samples(batch.select(torch.tensor(tiles)), self.run_dir / "samples" / f"step_{self.step:06d}",
                             self.plan.shape.fps, baselines)
            metrics["eval/reward_mean"] = mean
            metrics["time/eval"] = time.perf_counter() - t0
        except StopRequested:  # the step itself is complete: it is logged and saved, then every rank stops
            self.say(f"polyrl: evaluation at step {self.step} abandoned")
        finally:
            self.bar.set_description_str(self.cfg.name)
            self._phase = "idle"

    def _grid_tiles(self, batch: Rollout) -> tuple[list[int], list[float] | None]:
        """The grid's samples, chosen once per run from its first evaluation's rewards to span hard to easy prompts
        (`pick_tiles`) and kept in samples/grid.json: every later grid, also after a resume, shows the same prompts
        from the same noise, each captioned with its reward then and now."""
        path = self.run_dir / "samples" / "grid.json"
        k = min(self.cfg.trainer.num_validation, len(batch))
        if self._tiles is None and path.is_file():
            try:
                self._tiles = json.loads(path.read_text())
            except ValueError:
                self._tiles = None
        tiles = (self._tiles or {}).get("tiles", [])
        if len(tiles) != k or any(not 0 <= i < len(batch) for i in tiles):
            keys = [p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str) for p in batch.prompts]
            tiles = pick_tiles(keys, batch.rewards, k)
            self._tiles = {"step": self.step, "tiles": tiles, "rewards": [float(batch.rewards[i]) for i in tiles]}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self._tiles))
        return tiles, (self._tiles["rewards"] if self._tiles["step"] != self.step else None)

    # ------------------------------------------------------------------------------------------- loop
    def fit(self) -> list[dict]:
        """Train to trainer.max_steps. SIGINT / SIGTERM stop the run (`_on_signal`); a signal or a failure saves the
        last completed step first (`_recover`), then RunStopped (signals) or the failure is raised."""
        t, main = self.cfg.trainer, self.engine.is_main
        self.bar = tqdm(total=t.max_steps, initial=self.step, desc=self.cfg.name, disable=not (t.progress and main),
                        dynamic_ncols=True)
        try:
            with self._signal_handlers():
                try:
                    if self.step == 0 and t.eval_every > 0 and (main or self.engine.sharded):
                        m = {"step": 0}
                        self._eval_and_grid(m)
                        if main:
                            self.logger.log(m)
                    while self.step < t.max_steps and not self._stop_agreed():
                        self._one_step()
                except StopRequested as e:
                    self._stop = self._stop or e.signum
                    self._stop_note = self._recover(collective=False)
                except BaseException as e:
                    raise self._failed(e) from e
                else:
                    if self._stop is not None:
                        self._stop_note = self._recover(collective=True)
            if self._stop is not None:
                name = signal.Signals(self._stop).name
                raise RunStopped(f"stopped by {name} at step {self.step} of {t.max_steps}; {self._stop_note}"
                                 + (f"\nresume with: {resume_command(self.overrides, self.run_dir)}"
                                    if self.step > 0 else ""), self._stop)
        finally:
            self.bar.close()
            history = self._finish_logs()
        return history

    def _one_step(self) -> None:
        t = self.cfg.trainer
        self._sampler_before = self.sampler.state_dict()  # the data position before this step
        self._phase = "step"
        metrics = self.train_step()
        self.step += 1
        self._phase, self._snapshot, self._pending = "idle", None, metrics
        last = self.step == t.max_steps
        if t.eval_every > 0 and (self.step % t.eval_every == 0 or last):
            self._eval_and_grid(metrics)
        if self.engine.is_main:
            self.logger.log(metrics)
        self._pending = None
        if t.save_every > 0 and (self.step % t.save_every == 0 or last):
            self._save(collective=True)
        if self.engine.is_main and self.compiled and (self.step == 1 or self.saved_step == self.step):  # the first epoch compiled most; evals add more
            save_compile_cache(self.compile_cache)
        post = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
        if "eval/reward_mean" in metrics:
            post["heldout"] = f"{metrics['eval/reward_mean']:.3f}"
        self.bar.set_postfix(post)
        self.bar.update(1)

    def _save(self, collective: bool) -> Path:
        """Checkpoint the current step (rank 0 writes; with `collective`, every rank waits until it is complete)."""
        ckpt = checkpoint_dir(self.run_dir, self.step)
        if self.saved_step != self.step:
            self._phase = "save"
            if self.engine.sharded and not collective and self.engine.world_size > 1:
                raise CheckpointError("sharded weights are saved by every rank together, which a failure on one "
                                      "rank cannot ask for")
            if self.engine.is_main or self.engine.sharded:  # sharded: every rank writes its shards
                save_checkpoint(ckpt, self.actor, self.sampler, self.step, {}, engine=self.engine)
            if collective:
                self.engine.barrier()
            self.saved_step, self._phase = self.step, "idle"
        return ckpt

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: one small sum over ranks per step, so that every rank stops after
        the same step (a signal may reach one rank only, or reach them at different points of a step)."""
        if self.engine.world_size == 1:
            return self._stop is not None
        asked = self.engine.sum(torch.tensor([0 if self._stop is None else self._stop], device=self.engine.device))
        if int(asked) and self._stop is None:
            self._stop = int(signal.SIGTERM)  # another rank's signal
        return bool(int(asked))

    @contextmanager
    def _signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame) -> None:
        """First signal: abandon what can be redone (a rollout before any weight changed, one process; an
        evaluation), else finish the step's update and stop after it. A second signal stops at once (an update
        in progress is rolled back from its snapshot)."""
        first = self._stop is None
        self._stop = self._stop or signum
        if not first or self._phase == "eval" or (self._phase == "step" and self.engine.world_size == 1):
            # an abandoned evaluation is caught in `_eval_and_grid`; the stop then happens at the step's end
            raise StopRequested(signum)
        self.say(f"\npolyrl: {signal.Signals(signum).name}: stopping after this step (send it again to stop at once)")

    def _recover(self, collective: bool) -> str:
        """After a stop or a failure: undo the unfinished step (its prompts are drawn again on resume; an update in
        progress is rolled back), log a completed step whose evaluation was cut short, and save the last completed
        step. Returns what was done, for the message."""
        phase, self._phase = self._phase, "idle"
        if self._pending is not None and self.logger is not None:
            self.logger.log(self._pending)
            self._pending = None
        if phase in ("step", "update"):
            self.sampler.load_state_dict(self._sampler_before)
            if phase == "update":
                if self._snapshot is None:
                    last = checkpoint_dir(self.run_dir, self.saved_step) if self.saved_step else None
                    return (f"the weights were in the middle of an update and too large to keep a copy of (over "
                            f"{SNAPSHOT_MAX_PARAMS} trainable elements), so step {self.step} could not be saved; the "
                            f"last checkpoint is {last or 'none'}")
                self._snapshot.restore(self.actor)
        if self.step == 0:
            return "no training step had completed: nothing to save"
        try:
            ckpt = self._save(collective)
        except CheckpointError as e:
            return f"step {self.step} could not be saved: {e}"
        return f"saved checkpoint {ckpt} (step {self.step}); continue with trainer.resume={ckpt}"

    def _failed(self, error: BaseException) -> BaseException:
        """The exception to raise for a failure that stopped the run, after saving the last completed step: a
        reward service that gave up, or a non-finite gradient, is re-raised with the save note (the CLI prints it
        as one line); anything else keeps its type and traceback, the note printed first."""
        note = self._recover(collective=False)
        hint = f"\nresume with: {resume_command(self.overrides, self.run_dir)}" if self.step > 0 else ""
        if isinstance(error, (RewardUnavailable, FloatingPointError)):
            return type(error)(f"{error}\n{note}{hint}")
        if isinstance(error, Exception):
            self.say(f"polyrl: the run failed in step {self.step + 1} ({type(error).__name__}); {note}{hint}")
        return error

    def _finish_logs(self) -> list[dict]:
        """The reward curve and closing the loggers; a failure here is reported, never raised over the run's own
        outcome."""
        if self.logger is None:
            return []
        history = []
        try:
            history = self.logger.history()
            if history:
                plot_reward_curve(history, self.run_dir / "reward_curve.png")
        except Exception as e:
            self.say(f"polyrl: warning: could not write {self.run_dir / 'reward_curve.png'} ({type(e).__name__}: {e})")
        self.logger.close()
        return history

    def close(self) -> None:
        self.noise_ahead.close()
        self.reward_stage.close()
        if self.remote is not None:
            self.remote.close()
        self.engine.close()
