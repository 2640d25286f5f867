"""SIGTERM / Ctrl-C and failures: the run saves its last completed step, prints how to resume, and the resumed run
equals an uninterrupted one; data-parallel ranks stop together after the same step."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import pytest
from checkpoint_helpers import checkpoint_names, metrics, same_weights, step_weights, train_args, weights

from polyrl.actor.local import LocalActor
from polyrl.cli.main import main
from polyrl.rewards import RewardOutput, register_reward
from polyrl.rewards.jpeg import jpeg_kilobytes


@register_reward("test_signal")
class SignalReward:
    """−JPEG kB (jpeg_compressibility), and at call number `at` (1-based; 0: never) something goes wrong: the
    process sends itself `signum` `times` times, or, with signum=0, the scores are NaN."""

    def __init__(self, at: int = 0, signum: int = 15, times: int = 1, rank: int = -1):
        self.at, self.signum, self.times, self.rank, self.calls = at, signum, times, rank, 0

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        self.calls += 1
        scores = -jpeg_kilobytes(images, 95)
        if self.calls == self.at and self.rank in (-1, int(os.environ.get("RANK", "0"))):
            if self.signum == 0:
                return RewardOutput(scores * float("nan"))
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
        return RewardOutput(scores)


def _args(model_dir, prompts, out, steps, *extra):
    return train_args(model_dir, prompts, out, steps, "actor.num_minibatches=2", *extra, reward="test_signal")


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, run, 4)) == 0
    status = json.loads((run / "status.json").read_text())  # what `polyrl view` shows as the run's state
    assert (status["state"], status["step"], status["max_steps"], status["error"]) == ("finished", 4, 4, None)
    return run


def _resume_from_message(err: str) -> list[str]:
    line = next(x for x in err.splitlines() if x.startswith("resume with: "))
    command = shlex.split(line.removeprefix("resume with: "))
    assert command[:2] == ["polyrl", "train"] and command[-1] == "trainer.resume=auto"
    return command[1:]


def test_sigterm_during_a_rollout_abandons_it_and_the_printed_command_resumes_exactly(
        tiny_sd3_dir, shape_prompts_file, reference, tmp_path, capsys):
    run = tmp_path / "run"
    # no scheduled checkpoint before the end: the one on disk is the one the stop wrote
    code = main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10", "reward.at=3"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    ckpt = run / "checkpoints" / "step_000002"
    assert f"polyrl: stopped by SIGTERM at step 2 of 4; saved checkpoint {ckpt} (step 2)" in err
    assert checkpoint_names(run) == ["step_000002"]
    assert [m["step"] for m in metrics(run)] == [1, 2]  # the abandoned step 3 left nothing behind
    assert same_weights(weights(ckpt), step_weights(reference, 2))
    command = _resume_from_message(err)
    assert "reward.at=3" in command  # the same overrides (the counter restarts: it fires at call 3 of the new run)
    assert main(command) == 0
    assert metrics(run) == metrics(reference)
    assert same_weights(step_weights(run, 4), step_weights(reference, 4))


def test_a_first_signal_during_the_update_finishes_the_step(tiny_sd3_dir, shape_prompts_file, reference, tmp_path,
                                                            capsys, monkeypatch):
    original = LocalActor.update

    def update(self, algo, batch, generator):
        if self.num_updates == 2:  # the update of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, algo, batch, generator)

    monkeypatch.setattr(LocalActor, "update", update)
    run = tmp_path / "run"
    code = main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert "polyrl: SIGINT: stopping after this step" in err
    assert "stopped by SIGINT at step 3 of 4" in err
    assert same_weights(step_weights(run, 3), step_weights(reference, 3))
    assert metrics(run) == metrics(reference)[:3]


def test_a_second_signal_during_the_update_rolls_it_back(tiny_sd3_dir, shape_prompts_file, reference, tmp_path,
                                                         capsys, monkeypatch):
    original = LocalActor.update

    def update(self, algo, batch, generator):
        out = original(self, algo, batch, generator)
        if self.num_updates == 3:  # step 3's update has changed the weights: stop at once
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(LocalActor, "update", update)
    run = tmp_path / "run"
    code = main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM at step 2 of 4" in err
    # the saved weights and optimizer are step 2's, not step 3's half-applied update
    assert same_weights(step_weights(run, 2), step_weights(reference, 2))
    monkeypatch.setattr(LocalActor, "update", original)
    assert main(_resume_from_message(err)) == 0
    assert metrics(run) == metrics(reference)


EVALS = ("trainer.eval_every=2", "trainer.save_every=10", "trainer.eval_samples=2", "trainer.num_validation=2")


@pytest.mark.parametrize("where", [
    # reward calls: step-0 evaluation, steps 1 and 2, then the evaluation after step 2
    ("reward.at=4",),
    # the extra scorer's second call: inside the hacking watch of step 2's evaluation, after the reward scored it
    ("trainer.eval_scorers=[test_signal]", "+trainer.eval_scorer_args.test_signal.at=2"),
], ids=["reward", "eval_scorer"])
def test_a_signal_during_an_evaluation_saves_the_step_and_the_resume_evaluates_it_once(
        tiny_sd3_dir, shape_prompts_file, tmp_path, capsys, where):
    """Issue 52: an evaluation is part of its step. SIGTERM in the middle of step 2's evaluation saves step 2 with
    its evaluation due (not logged); the resumed run evaluates step 2 first, so metrics.jsonl, the sample grids and
    the scorers' numbers equal an uninterrupted run's, every step once."""
    reward = "jpeg_compressibility" if where[0].startswith("trainer.eval_scorers") else "test_signal"
    reference, run = tmp_path / "reference", tmp_path / "run"
    quiet = [w.replace(".at=4", ".at=0").replace(".at=2", ".at=0") for w in where]
    assert main(train_args(tiny_sd3_dir, shape_prompts_file, reference, 3, *EVALS, *quiet, reward=reward)) == 0
    capsys.readouterr()
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, run, 3, *EVALS, *where, reward=reward))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    ckpt = run / "checkpoints" / "step_000002"
    assert f"stopped by SIGTERM at step 2 of 3; saved checkpoint {ckpt} (step 2; its evaluation runs again on " \
           "resume)" in err
    assert [m["step"] for m in metrics(run)] == [0, 1]  # step 2 is logged with its evaluation, after the resume
    status = json.loads((run / "status.json").read_text())  # what `polyrl view` shows as the run's state
    assert (status["state"], status["step"], status["pid"]) == ("stopped", 2, os.getpid())
    assert status["error"].startswith("RunStopped: stopped by SIGTERM at step 2 of 3")
    # resumed with the evaluation's signal off (each run counts its calls from 1)
    command = [a.replace(".at=4", ".at=0").replace(".at=2", ".at=0") for a in _resume_from_message(err)]
    assert main(command) == 0
    assert "from step_000002 (step 2, at its evaluation)" in capsys.readouterr().err
    assert metrics(run) == metrics(reference)
    assert "eval/reward_mean" in metrics(run)[2]
    if reward == "jpeg_compressibility":
        assert "eval/test_signal" in metrics(run)[2] and "eval/hacking_alarm" in metrics(run)[2]
    for name in ("step_000000.png", "step_000002.png", "step_000002.jsonl", "step_000003.png", "grid.json"):
        assert (run / "samples" / name).read_bytes() == (reference / "samples" / name).read_bytes(), name


def test_a_signal_before_any_step_saves_nothing(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(_args(tiny_sd3_dir, shape_prompts_file, run, 2, "reward.at=1"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at step 0 of 2; no training step had completed: nothing to save" in err
    assert "resume with" not in err and not (run / "checkpoints").exists()


def test_a_failing_step_saves_the_last_completed_one_and_a_plot_error_does_not_hide_it(
        tiny_sd3_dir, shape_prompts_file, reference, tmp_path, capsys, monkeypatch):
    import polyrl.trainer.loop as loop

    def broken_plot(*args, **kwargs):
        raise RuntimeError("the plot broke")

    monkeypatch.setattr(loop, "plot_reward_curve", broken_plot)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="returned 4 scores for 4 images \\(non-finite: 4\\)"):
        main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10", "reward.at=3",
                   "reward.signum=0"))
    err = capsys.readouterr().err
    ckpt = run / "checkpoints" / "step_000002"
    assert f"polyrl: the run failed in step 3 (RuntimeError); saved checkpoint {ckpt} (step 2)" in err
    assert "could not write" in err and "the plot broke" in err
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("failed", 2) and status["error"].startswith("RuntimeError: ")
    assert same_weights(weights(ckpt), step_weights(reference, 2))


def test_a_non_finite_gradient_stops_with_one_line_and_a_rolled_back_checkpoint(
        tiny_sd3_dir, shape_prompts_file, reference, tmp_path, capsys, monkeypatch):
    original = LocalActor.update

    def update(self, algo, batch, generator):
        out = original(self, algo, batch, generator)
        if self.num_updates == 3:  # after the first mini-batches stepped
            raise FloatingPointError("non-finite gradient norm nan")
        return out

    monkeypatch.setattr(LocalActor, "update", update)
    run = tmp_path / "run"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10")) == 3
    err = capsys.readouterr().err
    ckpt = run / "checkpoints" / "step_000002"
    assert f"polyrl: stopped: non-finite gradient norm nan\nsaved checkpoint {ckpt} (step 2)" in err
    assert "resume with: polyrl train" in err
    assert same_weights(weights(ckpt), step_weights(reference, 2))


def test_data_parallel_ranks_stop_together(tiny_sd3_dir, shape_prompts_file, tmp_path):
    """SIGTERM reaches rank 1 only, in the middle of step 2's rollout: both ranks finish step 2, rank 0 saves it,
    both exit with 143 (no rank left waiting in a collective)."""
    run = tmp_path / "run"
    args = _args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.save_every=10", "reward.at=2", "reward.rank=1",
                 "trainer.device=cpu", "trainer.deterministic=false")
    # this test module registers the reward: import it in every rank (the CLI's --import)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "polyrl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",  # tests/ on the path: checkpoint_helpers
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(launcher + [args[0], "--import", __file__, *args[1:]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "stopped by SIGTERM at step 2 of 4" in out.stderr, out.stderr[-3000:]
    assert [m["step"] for m in metrics(run)] == [1, 2]
    assert checkpoint_names(run) == ["step_000002"]
    assert "exitcode  : 143" in out.stderr  # the rank that got the signal; torchrun then ends the other
    # the resume command repeats the launcher (issue 52), and rank 0 alone says it
    assert out.stderr.count("stopped by SIGTERM") == 1
    resume = next(x for x in out.stderr.splitlines() if x.startswith("resume with: "))
    assert resume.startswith(f"resume with: {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 "
                             f"-m polyrl train --import {__file__} ")
    assert resume.endswith(f"trainer.output_dir={run} trainer.resume=auto")
