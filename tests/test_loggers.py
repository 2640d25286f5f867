"""Run outputs: the optional W&B (offline mode) and MLflow (local file store) loggers, the held-out grid (tiles from
hard to easy prompts, whole captions, per-tile reward then and now) and the progress bar during an evaluation."""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest
import torch
from PIL import ImageDraw

from polyrl.cli.main import main
from polyrl.trainer.logging import MetricsLogger, grid_image, pick_tiles, wrap_text


def _tiny(model_dir, prompts, out, *extra):
    return ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            "trainer.max_steps=2", "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
            "trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0", "reward=jpeg_compressibility",
            "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]", *extra]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_wandb_offline_and_mlflow_file_store(tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    run = tmp_path / "run"
    assert main(_tiny(tiny_sd3_dir, shape_prompts_file, run, "trainer.loggers=[tensorboard,wandb,mlflow]")) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert glob.glob(str(run / "tensorboard" / "events.*"))

    import mlflow

    client = mlflow.MlflowClient(store.as_uri())
    run_id = (run / "mlflow_run_id").read_text()
    history = client.get_metric_history(run_id, "reward.mean")  # "/" -> "." (file store paths)
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in rows]
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.data.params["rollout.n"] == "2"
    assert set(info.data.metrics) >= {"ratio_absdev", "ratio_absdev.first_minibatch", "reward.std"}

    (record,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(record, "rb").read()  # the offline run's record log: our keys and values are in it
    assert b"reward/mean" in data and all(json.dumps(r["reward/mean"]).encode() in data for r in rows)


def test_loggers_are_off_by_default_and_imported_only_when_listed(tmp_path):
    code = ("import sys; from pathlib import Path; from polyrl.trainer.logging import MetricsLogger; "
            f"MetricsLogger(Path({str(tmp_path)!r}), ['tensorboard']).close(); "
            "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
    from polyrl.config import load_config

    assert list(load_config([]).trainer.loggers) == ["tensorboard"]


def test_a_logger_that_is_not_installed_is_one_error_line(tmp_path, monkeypatch):
    from polyrl.errors import UserError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match="trainer.loggers=wandb needs the wandb package"):
        MetricsLogger(tmp_path, ["wandb"])


def test_pick_tiles_spans_hard_to_easy_one_per_prompt():
    keys = ["a", "b", "c", "d", "e", "a", "b", "c"]
    rewards = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.0, 1.0, 0.2])
    tiles = pick_tiles(keys, rewards, 3)
    assert tiles == [1, 0, 2]  # lowest, median, highest of the first sample of each prompt
    assert pick_tiles(keys, rewards, 5) == [1, 3, 0, 4, 2]
    assert sorted(pick_tiles(keys, rewards, 8)) == list(range(8))  # fewer prompts than tiles: every sample


def test_grid_captions_hold_the_whole_prompt_and_both_rewards():
    draw = ImageDraw.Draw(grid_image(torch.zeros(1, 3, 8, 8), ["x"], None))
    prompt = "two red circles to the left of a blue square and three green triangles below them"
    lines = wrap_text(prompt, 60, draw)
    assert len(lines) > 3 and " ".join(lines) == prompt and all(draw.textlength(x) <= 60 for x in lines[:-1])
    short = grid_image(torch.rand(2, 3, 32, 32), ["a", "b"], [0.5, 0.25])
    long = grid_image(torch.rand(2, 3, 32, 32), [prompt, "b"], [0.5, 0.25], baselines=[0.1, 0.2])
    assert long.height > short.height and long.width == short.width  # the caption area grows, nothing is cut


def test_heldout_grid_keeps_its_tiles_and_the_bar_says_when_it_evaluates(tiny_sd3_dir, shape_prompts_file,
                                                                         tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_tiny(tiny_sd3_dir, shape_prompts_file, run, "trainer.eval_every=1", "trainer.eval_samples=4",
                      "trainer.num_validation=3", "trainer.progress=true")) == 0
    assert "(evaluating 4 held-out samples)" in capsys.readouterr().err
    grid = json.loads((run / "samples" / "grid.json").read_text())
    assert grid["step"] == 0 and len(grid["tiles"]) == 3
    assert grid["rewards"] == sorted(grid["rewards"])  # hardest first
    assert all((run / "samples" / f"step_00000{i}.png").is_file() for i in range(3))
