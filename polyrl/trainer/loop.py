"""A run's lifecycle: build the stages from config, resume, step to `trainer.max_steps` with a progress bar,
evaluate, checkpoint, stop cleanly on signals and failures, log.

It names no model family, policy kind or algorithm: the stages come from the registries (trainer/build.py) and
one step function runs every policy kind (trainer/step.py). It holds no rank logic beyond letting only rank 0
write and agreeing with the other ranks when to stop (distributed/engine.py); how a run stops and what it says
then is trainer/stopping.py.

A step is complete once its evaluation (when one is due) is: a stop or a failure during the evaluation saves the
trained step with its metrics and the random state before the evaluation (`eval_due` in the checkpoint), and the
resumed run re-enters the step at its evaluation (`_complete_step`), so every evaluation is logged once, with the
numbers and sample files of an uninterrupted run.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from ..config.schema import ConfigError
from ..distributed import build_engine
from ..errors import UserError
from ..models import MODELS
from ..models.base import policy_kind
from ..perf.compile import save_compile_cache
from ..perf.determinism import set_determinism
from ..rewards.stage import RewardStage
from .build import build_policy, build_reward_and_algorithm, load_data
from .checkpoint import checkpoint_dir, load_checkpoint, load_newest, rng_state, save_checkpoint, set_rng_state
from .disk import OptionalWrites, free_space_warning, is_disk_full
from .evaluation import HackingWatch, SampleFiles, evaluate
from .logging import MetricsLogger, plot_reward_curve
from .recovery import RankStopped, RunStopped, StopRequested, WeightSnapshot
from .run_dir import RunStatus, launch_command, resolve_on_main, write_outcome
from .step import Stages, pair_step, train_step
from .stopping import Stopping

__all__ = ["RankStopped", "RunStopped", "Trainer"]


class Trainer(Stopping):
    def __init__(self, cfg: DictConfig, overrides: list[str] | None = None):
        self.cfg = cfg
        self.overrides = list(overrides or [])  # for the resume command printed when a run stops
        self.peers = None  # PeerWatch of a multi-rank run (trainer/stopping.py)
        t = cfg.trainer
        if t.device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"trainer.device=cuda but torch {torch.__version__} sees no CUDA device "
                            f"({'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); "
                            "use trainer.device=cpu (or auto)")
        self.engine = build_engine(t.device, cfg)
        self.say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if self.engine.is_main else (lambda msg: None)
        self.launcher = launch_command(self.engine.world_size)  # how the run was started: the resume command's
        self._watch_peers()
        if cfg.data.prompts_per_step % self.engine.dp_size:
            raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the number of "
                              f"data-parallel ranks ({self.engine.dp_size})")
        self.run_dir, candidates, notes = resolve_on_main(self.engine, cfg)
        for note in notes:
            self.say(note)
        set_determinism(t.deterministic, self.say)
        torch.manual_seed(t.seed)
        self.device = self.engine.device
        self.reward, self.algo = build_reward_and_algorithm(cfg)
        self.reward_stage = RewardStage(self.reward, cfg.reward.name, overlap=bool(cfg.reward.get("async", False)))
        self.data = load_data(cfg, self.reward, policy_kind(MODELS.get(cfg.model.name)), self.say)
        self.adapter, self.sampler, self.actor, self.compile_cache = build_policy(
            cfg, self.engine, self.algo, self.say, self.run_dir, self.reward_stage.reads_media)
        self.compiled = cfg.model.get("compile", "none") != "none"
        self.step = 0
        self._resumed_eval: dict | None = None  # a step saved before its evaluation completed: re-entered there
        if candidates:
            if t.resume == "auto":  # the newest usable checkpoint, saying which were skipped
                loaded, state = load_newest(candidates, self.actor, self.data.source, self.say)
            else:  # the one named: no fallback
                loaded, state = candidates[0], load_checkpoint(candidates[0], self.actor, self.data.source)
            self.step = state["step"]
            self.reward_stage.load_reward_state(state.get("reward"))  # reward=mix's running statistics
            self._resumed_eval = state.get("eval_due")
            self.say(f"polyrl: resuming run {self.run_dir} from {loaded.name} (step {self.step}"
                     + (", at its evaluation" if self._resumed_eval else "") + ")"
                     + (" instead" if loaded != candidates[0] else ""))
        self.logger = None
        self._disk_full = False  # a full disk stopped the run (said once; nothing more is written)
        self._optional_write = OptionalWrites(self.say)  # samples, reward curve, compile cache: skipped when full
        if self.engine.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
                loggers = [name for name in t.loggers if t.tensorboard or name != "tensorboard"]
                # a step re-entered at its evaluation is logged again: whatever a stopped run logged of it is dropped
                resumed_at = self.step - (self._resumed_eval is not None) if t.resume is not None else None
                self.logger = MetricsLogger(self.run_dir, loggers, cfg.name, OmegaConf.to_container(cfg, resolve=True),
                                            warn=self.say, resumed_at=resumed_at)
                self.status = RunStatus(self.run_dir, t.max_steps)  # status.json: running, finished, stopped, failed
            except Exception as e:
                if is_disk_full(e):
                    raise self._as_disk_full(e) from e
                raise
            if self.logger.resume_note:
                self.say(f"polyrl: {self.logger.resume_note}")
        # held-out reward by step, for trainer.keep_best (a resumed run reads the earlier ones from its log)
        self._scores = ({m["step"]: m["eval/reward_mean"] for m in self.logger.history() if "eval/reward_mean" in m}
                        if self.logger is not None and t.keep_best else {})
        self.saved_step = self.step if candidates else None  # the step of the newest checkpoint on disk
        self._stop: int | None = None  # the signal that asked the run to stop
        self._phase = "idle"  # step (nothing trained yet) | update | eval | save | idle
        self._snapshot: WeightSnapshot | None = None
        self._source_before: dict | None = None
        self._pending: dict | None = None  # a trained step's metrics not yet logged
        self._eval_due: dict | None = None  # the trained step's evaluation not yet done: {metrics, rng} (checkpointed)
        self._recovering = False  # saving after a stop or failure: signals wait
        self._clean = False  # every rank ended together (the process group is closed with a barrier)
        self._stop_note = ""
        self.samples = SampleFiles(self.run_dir, t.num_validation, self.sampler.fps)
        self._first_eval: tuple[int, float] | None = None  # (step, held-out reward) of the run's first evaluation
        self._watch: HackingWatch | None = None  # trainer.eval_scorers: built at the first evaluation (rank 0)
        self.bar = tqdm(disable=True)  # fit's progress bar
        self.remote = None
        if t.launcher == "ray":
            self._launch_ray()
        self.stages = Stages(self.data.source, self.sampler, self.reward_stage, self.algo, self.actor, self.engine,
                             self._update, self.remote.sync if self.remote is not None else None,
                             self.remote.gpus if self.remote is not None else 0.0)

    def _launch_ray(self) -> None:
        """Worker groups on Ray: reward workers, and rollout replicas when rollout.workers > 0; they replace the
        local stages behind the same calls (`reward_stage.begin`, the sampler's rollout), and get the weights
        after updates."""
        if self.engine.world_size > 1:
            raise ConfigError("trainer.launcher=ray runs one driver process; start it with `polyrl train`, not torchrun")
        from .remote import launch  # Ray is imported only by a run that asks for it

        if not self.sampler.runs_on_replicas:  # refused before Ray starts
            raise ConfigError(f"trainer.launcher=ray drives diffusion policies; model.name={self.cfg.model.name} is "
                              "not one: use trainer.launcher=local")
        self.remote = launch(self.cfg, self.actor, self.adapter, self.reward_stage.reads_media)
        if self.remote.reward_stage is not None:
            self.reward_stage.close()
            self.reward_stage = self.remote.reward_stage
        if self.remote.rollout is not None:  # the replicas hold the sampling policy's weights (remote.py)
            self.sampler.use_remote(self.remote.rollout, self.cfg.rollout.max_staleness)

    # ------------------------------------------------------------------------------------------- stages
    def train_step(self) -> dict:
        if self.data.pairs is not None:
            return pair_step(self.stages, self.cfg, self.step, self.data.pairs)
        return train_step(self.stages, self.cfg, self.step)

    def _update(self, batch, generator: torch.Generator) -> dict:
        """The actor's update, after a copy of what it changes (WeightSnapshot) where that copy is small."""
        # the last snapshot goes first: its pinned buffers then serve this one (the host allocator caches them)
        self._snapshot = None
        self._snapshot = WeightSnapshot(self.actor) if WeightSnapshot.fits(self.actor) else None
        self._phase = "update"
        return self.actor.update(self.algo, batch, generator)

    def evaluate(self, n: int | None = None):
        """(mean held-out reward, the scored batch) of `trainer.eval_samples` deterministic samples, under the
        actor's evaluation weights (the evaluation EMA with actor.eval_ema_decay > 0)."""
        t, rows = self.cfg.trainer, self.data.heldout or self.data.source.rows
        with self.actor.evaluation_weights():
            return evaluate(self.sampler, self.reward, self.cfg.reward.name, rows, n or t.eval_samples, t.eval_seed)

    def _eval_and_grid(self, metrics: dict) -> bool:
        """Held-out evaluation and its samples (rank 0; the other ranks wait at the next collective, or evaluate
        too when the weights are sharded: each forward needs every rank). A stop signal abandons it at once (one
        process or rank 0 alone; sharded ranks finish it): False, the step is then saved with its evaluation due."""
        if not (self.engine.is_main or self.engine.sharded):
            return True
        self._phase = "eval"
        self.bar.set_description_str(f"{self.cfg.name} (evaluating {self.cfg.trainer.eval_samples} held-out samples)")
        self.bar.refresh()
        t0 = time.perf_counter()
        try:
            mean, batch = self.evaluate()
            if not self.engine.is_main:  # rank 0 writes
                return True
            if self.cfg.trainer.eval_scorers:  # extra scorers, the hacking watch; their values caption the grid
                if self._watch is None:
                    self._watch = HackingWatch(self.cfg, self.logger.history())
                watch_metrics, warning = self._watch.observe(batch, self.step)
                metrics.update(watch_metrics)
                if warning:
                    self.bar.write(warning, file=sys.stderr)
            self.samples.write(batch, self.step)  # part of the step: a full disk here stops the run (DiskFull)
            metrics["eval/reward_mean"] = mean
            if self.cfg.trainer.keep_best:
                self._scores[self.step] = mean
            metrics["time/eval"] = time.perf_counter() - t0
            self._print_eval(mean)
            return True
        except StopRequested:  # the trained step is saved with its evaluation due, then every rank stops
            for key in [k for k in metrics if k.startswith("eval/")]:  # what a scorer had added already
                del metrics[key]
            return False
        finally:
            self.bar.set_description_str(self.cfg.name)
            self._phase = "idle"

    def _print_eval(self, mean: float) -> None:
        """One line per evaluation, kept above the progress bar: the step, its held-out reward and the run's first
        one (the base model's when the run started from step 0)."""
        if self._first_eval is None:  # a resumed run reads it from its log
            first = [(m["step"], m["eval/reward_mean"]) for m in self.logger.history() if "eval/reward_mean" in m]
            self._first_eval = first[0] if first else (self.step, mean)
        step, first = self._first_eval
        since = f" (step {step}: {first:.4f})" if step != self.step else ""
        self.bar.write(f"polyrl: step {self.step}/{self.cfg.trainer.max_steps}: held-out reward {mean:.4f}{since}",
                       file=sys.stderr)

    # ------------------------------------------------------------------------------------------- loop
    def fit(self) -> list[dict]:
        """Train to trainer.max_steps. SIGINT / SIGTERM stop the run (`_on_signal`); a signal or a failure saves the
        last completed step first (`_recover`), then RunStopped (signals) or the failure is raised."""
        t, main = self.cfg.trainer, self.engine.is_main
        self.bar = tqdm(total=t.max_steps, initial=self.step, desc=self.cfg.name, disable=not (t.progress and main),
                        dynamic_ncols=True)
        if main:
            self.status.write("running", self.step)
            warning = free_space_warning(self.run_dir, self.actor, self.step, t)
            if warning:
                self.say(warning)
        try:
            with self._signal_handlers():
                try:
                    if self.step == 0 and t.eval_every > 0:
                        self._complete_step({"step": 0})
                    elif self._resumed_eval is not None:  # re-entered at the evaluation a stop cut short
                        set_rng_state(self._resumed_eval["rng"])
                        self._complete_step(dict(self._resumed_eval["metrics"]))
                    while self.step < t.max_steps and not self._stop_agreed():
                        self._one_step()
                except StopRequested as e:  # this rank alone: one process, a second signal, or a peer exited
                    self._stop = self._stop or e.signum
                    gone = self.peers.exits() if self.peers is not None else []
                    if gone:
                        raise self._peer_stopped(gone) from None
                    self._stop_note = self._recover(collective=False)
                    if self.peers is not None:
                        self.peers.publish(f"stopped by {signal.Signals(self._stop).name}", 128 + self._stop, main)
                except BaseException as e:
                    raise self._failed(e) from e
                else:
                    self._clean = True
                    if self._stop is not None:
                        self._stop_note = self._recover(collective=True)
            if self._stop is not None:
                name = signal.Signals(self._stop).name
                raise RunStopped(f"stopped by {name} at step {self.step} of {t.max_steps}; {self._stop_note}"
                                 + (self._hint() if self.step > 0 else ""), self._stop, report=main)
        finally:
            self.bar.close()
            history = self._finish_logs()
        return history

    def _one_step(self) -> None:
        self._source_before = self.data.source.state_dict()  # the data position before this step
        self._phase = "step"
        metrics = self.train_step()
        self.step += 1
        self._phase, self._snapshot = "idle", None
        self._complete_step(metrics)
        post = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
        if "eval/reward_mean" in metrics:
            post["heldout"] = f"{metrics['eval/reward_mean']:.3f}"
        self.bar.set_postfix(post)
        self.bar.update(1)

    def _complete_step(self, metrics: dict) -> None:
        """The rest of step `self.step` once it is trained (step 0: the base model's evaluation): its evaluation
        when one is due, its log line, its checkpoint. A stop during the evaluation leaves it due (`_eval_due`,
        saved in the checkpoint with the metrics and the random state before it); the resumed run comes back here."""
        t, main = self.cfg.trainer, self.engine.is_main
        self._pending = metrics
        if t.eval_every > 0 and (self.step % t.eval_every == 0 or self.step == t.max_steps):
            self._eval_due = {"metrics": _plain(metrics), "rng": rng_state()}
            if self._eval_and_grid(metrics):
                self._eval_due = None
        if self._eval_due is None:
            if main:
                self.logger.log(metrics)
            self._pending = None
        if self.step == 0:
            return
        if t.save_every > 0 and (self.step % t.save_every == 0 or self.step == t.max_steps):
            self._save(collective=True)
        if main and self.compiled and (self.step == 1 or self.saved_step == self.step):  # the first epoch compiled most; evals add more
            self._optional_write(f"the compile cache {self.compile_cache}", save_compile_cache, self.compile_cache)

    def _save(self, collective: bool) -> Path:
        """Checkpoint the current step (rank 0 writes; with `collective`, every rank waits until it is complete).
        A step whose evaluation is due is saved with it (`eval_due`)."""
        ckpt = checkpoint_dir(self.run_dir, self.step)
        if self.saved_step != self.step:
            self._phase = "save"
            if self.engine.is_main or self.engine.sharded:  # sharded: every rank writes its shards
                t = self.cfg.trainer  # rotation (rank 0) only once the new checkpoint is complete
                extra = self.reward_stage.checkpoint_extra()  # reward=mix's running statistics
                if self._eval_due is not None:
                    extra = {**extra, "eval_due": self._eval_due}
                save_checkpoint(ckpt, self.actor, self.data.source, self.step, extra, engine=self.engine,
                                keep=t.keep_checkpoints, scores=self._scores if t.keep_best else None, say=self.say)
            self.saved_step = self.step  # complete on disk: a barrier that fails now does not undo it
            if collective:
                self.engine.barrier()
            self._phase = "idle"
        return ckpt

    def _finish_logs(self) -> list[dict]:
        """The reward curve and closing the loggers; a failure here is reported, never raised over the run's own
        outcome."""
        if self.logger is None:
            return []
        if not self._disk_full:  # this runs in fit's `finally`: the exception in flight, if any, is its outcome
            write_outcome(self.status, self.step, sys.exc_info()[1])
        history = []
        try:
            history = self.logger.history()
            if history and not self._disk_full:
                self._optional_write(f"the reward curve {self.run_dir / 'reward_curve.png'}", plot_reward_curve,
                                     history, self.run_dir / "reward_curve.png")
        except Exception as e:
            self.say(f"polyrl: warning: could not write {self.run_dir / 'reward_curve.png'} ({type(e).__name__}: {e})")
        self.logger.close()
        return history

    def close(self) -> None:
        self.sampler.close()
        self.reward_stage.close()
        if self.remote is not None:
            self.remote.close()
        if self.peers is not None:
            self.peers.close()
        self.engine.close(barrier=self._clean)  # after a failure a rank may be gone: no barrier to wait in
        self._release_signals()


def _plain(metrics: dict) -> dict:
    """A step's metrics as plain Python numbers (a checkpoint's `eval_due` is read back with weights_only)."""
    return {k: (float(v) if isinstance(v, float) else int(v) if isinstance(v, int) and not isinstance(v, bool) else v)
            for k, v in metrics.items()}
