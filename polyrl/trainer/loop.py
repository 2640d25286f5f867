"""A run's lifecycle: build the stages from config, resume, step to `trainer.max_steps` with a progress bar,
evaluate, checkpoint, stop cleanly on signals and failures, log.

It names no model family, policy kind or algorithm: the stages come from the registries (trainer/build.py) and
one step function runs every policy kind (trainer/step.py). It holds no rank logic beyond letting only rank 0
write and agreeing with the other ranks when to stop (distributed/engine.py).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
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
from ..rewards.stage import RewardStage, RewardUnavailable
from .build import build_policy, build_reward_and_algorithm, load_data
from .checkpoint import (
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)
from .disk import DiskFull, OptionalWrites, as_disk_full, free_space_warning, is_disk_full
from .evaluation import HackingWatch, SampleFiles, evaluate
from .logging import MetricsLogger, plot_reward_curve
from .oom import oom_stage, out_of_memory
from .recovery import SNAPSHOT_MAX_PARAMS, RunStopped, StopRequested, WeightSnapshot
from .run_dir import RunStatus, resolve_on_main, resume_command, write_outcome
from .step import Stages, pair_step, train_step


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
        if candidates:
            if t.resume == "auto":  # the newest usable checkpoint, saying which were skipped
                loaded, state = load_newest(candidates, self.actor, self.data.source, self.say)
            else:  # the one named: no fallback
                loaded, state = candidates[0], load_checkpoint(candidates[0], self.actor, self.data.source)
            self.step = state["step"]
            self.reward_stage.load_reward_state(state.get("reward"))  # reward=mix's running statistics
            self.say(f"polyrl: resuming run {self.run_dir} from {loaded.name} (step {self.step})"
                     + (" instead" if loaded != candidates[0] else ""))
        self.logger = None
        self._disk_full = False  # a full disk stopped the run (said once; nothing more is written)
        self._optional_write = OptionalWrites(self.say)  # samples, reward curve, compile cache: skipped when full
        if self.engine.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
                loggers = [name for name in t.loggers if t.tensorboard or name != "tensorboard"]
                self.logger = MetricsLogger(self.run_dir, loggers, cfg.name, OmegaConf.to_container(cfg, resolve=True),
                                            warn=self.say, resumed_at=self.step if t.resume is not None else None)
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
        self._pending: dict | None = None  # a completed step's metrics not yet logged
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

    def _eval_and_grid(self, metrics: dict) -> None:
        """Held-out evaluation and its samples (rank 0; the other ranks wait at the next collective, or evaluate
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
            if self.cfg.trainer.eval_scorers:  # extra scorers, the hacking watch; their values caption the grid
                if self._watch is None:
                    self._watch = HackingWatch(self.cfg, self.logger.history())
                watch_metrics, warning = self._watch.observe(batch, self.step)
                metrics.update(watch_metrics)
                if warning:
                    self.bar.write(warning, file=sys.stderr)
            self._optional_write(f"the samples of step {self.step} under {self.samples.dir}",
                                 self.samples.write, batch, self.step)
            metrics["eval/reward_mean"] = mean
            if self.cfg.trainer.keep_best:
                self._scores[self.step] = mean
            metrics["time/eval"] = time.perf_counter() - t0
            self._print_eval(mean)
        except StopRequested:  # the step itself is complete: it is logged and saved, then every rank stops
            self.say(f"polyrl: evaluation at step {self.step} abandoned")
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
        self._source_before = self.data.source.state_dict()  # the data position before this step
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
            self._optional_write(f"the compile cache {self.compile_cache}", save_compile_cache, self.compile_cache)
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
                t = self.cfg.trainer  # rotation (rank 0) only once the new checkpoint is complete
                extra = self.reward_stage.checkpoint_extra()  # reward=mix's running statistics
                save_checkpoint(ckpt, self.actor, self.data.source, self.step, extra, engine=self.engine,
                                keep=t.keep_checkpoints, scores=self._scores if t.keep_best else None, say=self.say)
            if collective:
                self.engine.barrier()
            self.saved_step, self._phase = self.step, "idle"
        return ckpt

    def _as_disk_full(self, error: BaseException) -> DiskFull:
        """A full disk stops the run with one line; nothing more is written (not even the metrics log)."""
        self._disk_full = True
        if self.logger is not None:
            self.logger.disk_full = True
        return as_disk_full(error, self.run_dir, latest_checkpoint(self.run_dir),
                            resume_command(self.overrides, self.run_dir))

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
            try:
                self.logger.log(self._pending)
            except DiskFull as e:
                raise self._as_disk_full(e) from e
            self._pending = None
        if phase in ("step", "update"):
            self.data.source.load_state_dict(self._source_before)
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
        except DiskFull as e:  # the last complete checkpoint stays the resume point: one line says so
            raise self._as_disk_full(e) from e
        except CheckpointError as e:
            return f"step {self.step} could not be saved: {e}"
        return f"saved checkpoint {ckpt} (step {self.step})"

    def _failed(self, error: BaseException) -> BaseException:
        """The exception to raise for a failure that stopped the run, after saving the last completed step: a
        reward service that gave up, or a non-finite gradient, is re-raised with the save note (the CLI prints it
        as one line); anything else keeps its type and traceback, the note printed first. A full disk is DiskFull,
        one line, with nothing more written: no second checkpoint on the full disk, the step that was in progress
        is redone after resuming from the last complete checkpoint. An out-of-memory is one line too (trainer/oom.py)."""
        if is_disk_full(error):
            return self._as_disk_full(error)
        oom = oom_stage(error, self._phase)  # before _recover: it frees the failed stage's tensors
        note = self._recover(collective=False)
        hint = f"\nresume with: {resume_command(self.overrides, self.run_dir)}" if self.step > 0 else ""
        if isinstance(error, (RewardUnavailable, FloatingPointError)) or oom:
            return out_of_memory(error, oom, self.cfg, note + hint) if oom else type(error)(f"{error}\n{note}{hint}")
        if isinstance(error, Exception):
            self.say(f"polyrl: the run failed in step {self.step + 1} ({type(error).__name__}); {note}{hint}")
        return error

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
        self.engine.close()
