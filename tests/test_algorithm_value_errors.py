"""An algorithm's own value checks (ranges, choices; in its constructor) reach the user as one `polyrl: config
error:` line, before anything loads: DGPO, AWM and token OPD."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main


@pytest.mark.parametrize("extra, message", [
    (["algorithm=dgpo", "algorithm.clip_range=[0.1,0.2]"], "algorithm.clip_range=[0.1, 0.2] must be [low, high]"),
    (["algorithm=awm", "algorithm.clip_range=0.1"], "algorithm.clip_range=0.1 must be [low, high]"),  # a scalar
    (["algorithm=dgpo", "algorithm.timestep_range=[0.7,0.2]"], "algorithm.timestep_range=[0.7, 0.2] must be"),
    (["algorithm=awm", "algorithm.weighting=cubic"], "algorithm.weighting='cubic'; allowed"),
    (["algorithm=awm", "algorithm.time_sampling=logit"], "algorithm.time_sampling='logit'; allowed"),
    (["algorithm=diffusion_nft", "algorithm.mix_beta=2"], "algorithm.mix_beta=2 must be in (0, 1]"),
])
def test_diffusion_algorithm_value_errors(tmp_path, capsys, extra, message):
    assert main(["train", "recipe=toy_common", f"trainer.output_dir={tmp_path}", *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl:")]
    assert len(lines) == 1 and lines[0].startswith("polyrl: config error:") and message in lines[0], lines


@pytest.mark.parametrize("extra, message", [
    (["algorithm.task_loss=ppo"], "algorithm.task_loss='ppo'; allowed: none, grpo, gspo"),
    (["algorithm.opd_coef=0"], "algorithm.opd_coef=0 must be > 0"),
    (["algorithm.task_options={clip_range: 0.1}"], "algorithm.task_options is set but algorithm.task_loss=none"),
    (["algorithm.task_loss=grpo", "algorithm.task_options={clip: 0.1}"], "algorithm.task_options for task_loss=grpo"),
])
def test_token_opd_value_errors(tmp_path, capsys, extra, message):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "two?", "answer": "2"}) + "\n")
    args = ["train", "recipe=toy_count", f"data.path={data}", f"trainer.output_dir={tmp_path / 'run'}",
            "algorithm=opd", f"algorithm.teacher_path={tmp_path}", *extra]
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl:")]
    assert len(lines) == 1 and lines[0].startswith("polyrl: config error:") and message in lines[0], lines
