"""The training loop: prompts → rollout → reward → advantage → update, with eval, logging and checkpoints.

It holds no model or algorithm special case: those live behind the model, reward, algorithm and actor
registries, built from the config. It holds no rank logic beyond asking the engine for this rank's share of the
step's prompt groups, gathering the step's rewards, and letting only rank 0 write (distributed/engine.py).
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ..actor.local import LocalActor
from ..algorithms import build_algorithm, compute_advantages
from ..algorithms.advantage import zero_std_ratio
from ..batch import Rollout
from ..config.schema import ConfigError
from ..data.pairs import load_pairs, pair_batch
from ..data.prompts import PromptSampler, load_prompts, split_row
from ..distributed.engine import LocalEngine, build_engine
from ..latents import MediaShape
from ..models import build_model
from ..models.base import Guidance
from ..perf.compile import compile_transformer
from ..perf.fp8 import apply_fp8
from ..perf.timer import StageTimer
from ..rewards import build_reward
from ..rewards.stage import RewardStage, RewardUnavailable, merge_extras, score_batch
from ..sampling.diffusion import SamplingPlan, draw_noise, rollout
from .checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from .logging import MetricsLogger, plot_reward_curve, save_samples


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The RNG of one (step, purpose): independent of everything before it, so resume is exact."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 16 + stream)


def plan_from_config(r: DictConfig) -> SamplingPlan:
    return SamplingPlan(
        num_steps=r.num_steps, shape=MediaShape(height=r.height, width=r.width, frames=r.num_frames, fps=r.fps),
        guidance=Guidance(r.guidance_scale, r.negative_prompt), noise_level=r.noise_level,
        window_size=r.sde_window_size, window_range=tuple(r.sde_window_range), batch_size=r.batch_size, step=r.step,
        window_strategy=r.sde_window_strategy, window_every=r.sde_window_every, shared_noise=r.shared_initial_noise,
        log_density=r.log_density,
    )


def resolve_run_dir(cfg: DictConfig) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None)."""
    t = cfg.trainer
    if t.resume not in (None, "auto"):
        ckpt = Path(t.resume)
        if not (ckpt / "trainer_state.pt").is_file():
            raise FileNotFoundError(f"trainer.resume={t.resume!r} is not a checkpoint directory (no trainer_state.pt)")
        return ckpt.parent.parent, ckpt
    if t.output_dir is not None:
        run_dir = Path(t.output_dir)
    else:
        root = Path("runs") / cfg.name
        runs = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
        with_ckpt = [p for p in runs if latest_checkpoint(p) is not None]
        if t.resume == "auto" and with_ckpt:
            run_dir = with_ckpt[-1]
        else:
            run_dir = root / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if ckpt is not None and t.resume is None:
        raise FileExistsError(
            f"trainer.output_dir={str(run_dir)!r} already holds a run; pass trainer.resume=auto to continue it, "
            "or choose another trainer.output_dir"
        )
    return run_dir, ckpt


def resolve_on_main(engine: LocalEngine, cfg: DictConfig) -> tuple[Path, Path | None]:
    """Rank 0 resolves the run directory (its clock names a new run) and every rank uses its answer or error."""
    answer = None
    if engine.is_main:
        try:
            answer = resolve_run_dir(cfg)
        except (FileNotFoundError, FileExistsError) as e:
            answer = e
    answer = engine.broadcast_object(answer)
    if isinstance(answer, Exception):
        raise answer
    return answer


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


class Trainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        t = cfg.trainer
        self.engine = build_engine(t.device)
        if cfg.data.prompts_per_step % self.engine.world_size:
            raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the number of "
                              f"data-parallel ranks ({self.engine.world_size})")
        self.run_dir, resume_from = resolve_on_main(self.engine, cfg)
        set_determinism(t.deterministic)
        torch.manual_seed(t.seed)
        self.device = self.engine.device
        # Everything that can fail on a bad config or bad data fails here, before the model is loaded.
        self.reward = build_reward(OmegaConf.to_container(cfg.reward))
        self.reward_stage = RewardStage(self.reward, cfg.reward.name, overlap=bool(cfg.reward.get("async", False)))
        self.algo = build_algorithm(OmegaConf.to_container(cfg.algorithm))
        # Offline pairs (data.pairs_path) replace the prompts: each step trains on a batch of pairs, no rollout.
        self.pairs = load_pairs(cfg.data.pairs_path) if cfg.data.pairs_path else None
        self.sampler = PromptSampler(self.pairs or load_prompts(cfg.data.path), t.seed, cfg.data.shuffle)
        self.heldout = load_prompts(cfg.data.heldout_path) if cfg.data.heldout_path else None
        self.plan = plan_from_config(cfg.rollout)

        self.adapter = build_model(cfg.model, self.device)
        try:  # a media shape the model cannot make is a config error, reported before anything runs
            self.latent_shapes = self.adapter.latent_shapes(self.plan.shape)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.actor = LocalActor(self.adapter, cfg.actor, self.plan, self.algo, cfg.rollout_correction, self.engine)
        for network in self.adapter.modules().values():
            if cfg.model.fp8:
                apply_fp8(network)  # after LoRA: only the frozen base layers are swapped
            compile_transformer(network, cfg.model.compile)  # after LoRA, so the graph includes it
        self.logger = None
        if self.engine.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            self.logger = MetricsLogger(self.run_dir, t.tensorboard)
        self.step = 0
        if resume_from is not None:
            state = load_checkpoint(resume_from, self.actor, self.sampler)
            self.step = state["step"]
            if self.logger is not None:
                self.logger.truncate_after(self.step)

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
        batch = pair_batch(self.adapter, rows, cfg.rollout.height, cfg.rollout.width)
        t1 = time.perf_counter()
        stats = self.actor.update(self.algo, batch, step_generator(cfg.trainer.seed, step, stream=1))
        t2 = time.perf_counter()
        return {"step": step + 1, **stats, "lr": self.actor.optimizer.param_groups[0]["lr"],
                "time/encode": t1 - t0, "time/train": t2 - t1, "time/step": t2 - t0}

    def train_step(self) -> dict:
        cfg, step, engine = self.cfg, self.step, self.engine
        if self.pairs is not None:
            return self.pair_step()
        timer = StageTimer(self.device)
        flops_before = getattr(self.adapter, "flops", 0.0)
        n = cfg.rollout.n
        with timer("step"):
            rows = self.sampler.next(cfg.data.prompts_per_step)  # the global step: every rank draws the same rows
            group_ids = torch.arange(len(rows)).repeat_interleave(n)
            share = engine.shard(len(rows))
            mine = torch.arange(share.start * n, share.stop * n)  # this rank's samples (whole groups)
            prompts, metadata = [], []
            for row in rows[share.start:share.stop]:
                prompt, meta = split_row(row)
                prompts += [prompt] * n
                metadata += [meta] * n
            # the whole step's draws, then this rank's rows: the numbers do not depend on the world size
            noise = draw_noise(self.latent_shapes, self.plan, group_ids, step_generator(cfg.trainer.seed, step),
                               step).select(mine)
            with timer("text_encode"):  # fills the model's prompt cache; the rollout then reads it
                self.adapter.encode_prompts(prompts)
                self.adapter.encode_guidance(self.plan.guidance)
            # reward: after the rollout, or chunk by chunk during it (reward.async, rewards/stage.py)
            scoring = self.reward_stage.begin(prompts, metadata)
            try:
                with timer("rollout"), self.actor.sampling_policy():
                    batch = rollout(self.adapter, prompts, metadata, group_ids[mine], self.plan, noise,
                                    decode=self.reward_stage.reads_media, sink=scoring, times=timer.times)
            except BaseException:
                scoring.cancel()
                raise
            scoring.finish(batch, timer)
            rewards = engine.gather(batch.rewards)  # the step's rewards, in global sample order
            advantages = compute_advantages(self.algo, rewards, group_ids)
            batch.advantages = advantages[mine]
            with timer("train"):
                stats = self.actor.update(self.algo, batch, step_generator(cfg.trainer.seed, step, stream=1))
        timings = timer.times
        step_flops = float(engine.sum(torch.tensor(getattr(self.adapter, "flops", 0.0) - flops_before,
                                                   dtype=torch.float64, device=engine.device)))
        if step_flops > 0:
            timings["perf/tflops"] = step_flops / 1e12
            timings["perf/achieved_tflops_per_s"] = step_flops / 1e12 / timings["time/step"]
            if cfg.trainer.peak_tflops:
                timings["perf/mfu"] = timings["perf/achieved_tflops_per_s"] / (cfg.trainer.peak_tflops * engine.world_size)
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

    # ------------------------------------------------------------------------------------------- eval
    def evaluate(self, n: int | None = None) -> tuple[float, Rollout]:
        return evaluate(self.adapter, self.reward, self.cfg, self.heldout or self.sampler.rows, self.plan, n)

    def _eval_and_grid(self, metrics: dict) -> None:
        """Held-out evaluation and the sample grid (rank 0; the other ranks wait at the next collective)."""
        if not self.engine.is_main:
            return
        t0 = time.perf_counter()
        mean, batch = self.evaluate()
        k = min(self.cfg.trainer.num_validation, len(batch))
        save_samples(batch.select(torch.arange(k)), self.run_dir / "samples" / f"step_{self.step:06d}",
                     self.plan.shape.fps)
        metrics["eval/reward_mean"] = mean
        metrics["time/eval"] = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------- loop
    def _stop_after_reward_failure(self, error: Exception, sampler_state: dict | None, unlogged: dict | None) -> str:
        """Checkpoint the last completed step (a failed step is dropped: its prompts are drawn again on
        resume) and return the stop message."""
        if unlogged is not None and self.logger is not None:  # the step trained, then its evaluation failed
            self.logger.log(unlogged)
        if sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        if self.step == 0:
            return f"{error}\nno training step had completed: nothing to save"
        ckpt = checkpoint_dir(self.run_dir, self.step)
        if self.engine.is_main and not (ckpt / "trainer_state.pt").is_file():
            save_checkpoint(ckpt, self.actor, self.sampler, self.step, {})
        return f"{error}\nsaved checkpoint {ckpt} (step {self.step}); continue with trainer.resume={ckpt}"

    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        main = self.engine.is_main
        if self.step == 0 and t.eval_every > 0 and main:
            m = {"step": 0}
            self._eval_and_grid(m)
            self.logger.log(m)
        bar = tqdm(total=t.max_steps, initial=self.step, desc=self.cfg.name, disable=not (t.progress and main),
                   dynamic_ncols=True)
        sampler_state, unlogged = None, None  # for a stop on a reward-service failure (see below)
        try:
            while self.step < t.max_steps:
                sampler_state = self.sampler.state_dict()  # the data position before this step
                metrics = self.train_step()
                self.step += 1
                sampler_state, unlogged = None, metrics
                last = self.step == t.max_steps
                if t.eval_every > 0 and (self.step % t.eval_every == 0 or last):
                    self._eval_and_grid(metrics)
                if main:
                    self.logger.log(metrics)
                unlogged = None
                if t.save_every > 0 and (self.step % t.save_every == 0 or last):
                    if main:
                        save_checkpoint(checkpoint_dir(self.run_dir, self.step), self.actor, self.sampler, self.step, {})
                    self.engine.barrier()  # a checkpoint is complete before any rank moves on
                post = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
                if "eval/reward_mean" in metrics:
                    post["heldout"] = f"{metrics['eval/reward_mean']:.3f}"
                bar.set_postfix(post)
                bar.update(1)
        except RewardUnavailable as e:
            raise RewardUnavailable(self._stop_after_reward_failure(e, sampler_state, unlogged)) from e
        finally:
            bar.close()
            history = []
            if self.logger is not None:
                history = self.logger.history()
                if history:
                    plot_reward_curve(history, self.run_dir / "reward_curve.png")
                self.logger.close()
        return history

    def close(self) -> None:
        self.reward_stage.close()
        self.engine.close()
