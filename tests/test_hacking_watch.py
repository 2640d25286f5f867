"""The reward-hacking watch wired into training (`trainer.eval_scorers`, trainer/evaluation.py HackingWatch): extra
held-out scorers logged as eval/<scorer>, and eval/hacking_alarm with one warning line when the training reward rose
while another scorer fell by more than its noise."""

import json

import pytest
import torch

from polyrl.cli.main import main
from polyrl.rewards import REWARDS, RewardOutput


class Rising:
    """The training reward: the same score for every sample, one step higher at every call."""

    calls = 0

    def __call__(self, images, prompts, metadata=None):
        Rising.calls += 1
        return RewardOutput(torch.full((len(images),), 0.1 * Rising.calls))


class Falling:
    """A held-out scorer that drops by 0.2 at every call (every evaluation)."""

    calls = 0

    def __call__(self, images, prompts, metadata=None):
        Falling.calls += 1
        return RewardOutput(torch.full((len(images),), 1.0 - 0.2 * Falling.calls))


class Steady:
    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(images.float().mean(dim=(1, 2, 3)) * 0 + 0.5)


@pytest.fixture
def scorers(monkeypatch):
    Rising.calls = Falling.calls = 0
    for name, cls in (("rising", Rising), ("falling", Falling), ("steady", Steady)):
        monkeypatch.setitem(REWARDS, name, cls)


def _train(model_dir, prompts, out, extra):
    return main(["train", f"model.path={model_dir}", f"data.path={prompts}", f"data.heldout_path={prompts}",
                 f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.height=32", "rollout.width=32",
                 "rollout.num_steps=2", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
                 "model.max_sequence_length=16", "trainer.eval_samples=4", "trainer.num_validation=0",
                 "trainer.eval_every=1", "trainer.save_every=0", "trainer.progress=false", "trainer.loggers=[]",
                 "reward=rising", "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]", *extra])


def _evals(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/reward_mean" in r]


def test_alarm_fires_once_when_the_reward_rises_and_a_scorer_falls(tiny_sd3_dir, shape_prompts_file, scorers,
                                                                     tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tiny_sd3_dir, shape_prompts_file, out, ["trainer.eval_scorers=[falling,steady]"]) == 0
    evals = _evals(out)
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert [e["eval/falling"] for e in evals] == pytest.approx([0.8, 0.6, 0.4])
    assert [e["eval/steady"] for e in evals] == pytest.approx([0.5, 0.5, 0.5])
    assert all(e["eval/falling/ci95_lo"] == pytest.approx(e["eval/falling"]) for e in evals)  # no noise: constant
    assert all(e["eval/rising"] == pytest.approx(e["eval/reward_mean"]) for e in evals)
    assert [e["eval/hacking_alarm"] for e in evals] == [0.0, 1.0, 1.0]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "possible reward hacking" in line]
    assert len(warnings) == 1 and warnings[0].startswith("polyrl: warning: possible reward hacking at step 1: "
                                                         "held-out rising rose")
    assert "falling 0.8000 -> 0.6000" in warnings[0] and "steady" not in warnings[0]


def test_quiet_when_no_scorer_falls(tiny_sd3_dir, shape_prompts_file, scorers, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tiny_sd3_dir, shape_prompts_file, out, ["trainer.eval_scorers=[steady]"]) == 0
    assert [e["eval/hacking_alarm"] for e in _evals(out)] == [0.0, 0.0, 0.0]
    assert "possible reward hacking" not in capsys.readouterr().err


def test_eval_scorers_config_errors(tiny_sd3_dir, shape_prompts_file, scorers, tmp_path, capsys):
    assert _train(tiny_sd3_dir, shape_prompts_file, tmp_path / "a", ["trainer.eval_scorers=[pickscore]"]) == 2
    assert "scorer pickscore needs trainer.eval_scorer_args.pickscore.path=..." in capsys.readouterr().err
    assert _train(tiny_sd3_dir, shape_prompts_file, tmp_path / "b", ["trainer.eval_scorers=[nope]"]) == 2
    assert "trainer.eval_scorers: 'nope' is not a registered reward" in capsys.readouterr().err
