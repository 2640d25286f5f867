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


def test_a_signal_during_an_evaluation_abandons_it(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    run = tmp_path / "run"
    # calls: step-0 evaluation, steps 1 and 2, then the evaluation after step 2
    code = main(_args(tiny_sd3_dir, shape_prompts_file, run, 4, "trainer.eval_every=2", "trainer.save_every=10",
                      "trainer.eval_samples=2", "trainer.num_validation=2", "reward.at=4"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "polyrl: evaluation at step 2 abandoned" in err and "stopped by SIGTERM at step 2 of 4" in err
    rows = metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2] and "eval/reward_mean" not in rows[2]
    assert (run / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"], status["pid"]) == ("stopped", 2, os.getpid())
    assert status["error"].startswith("RunStopped: stopped by SIGTERM at step 2 of 4")


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
