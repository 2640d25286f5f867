"""`polyrl pretrain-toy --task text` at a tiny budget and `recipe=toy_ocr` through the CLI with the real OCR reward
(RapidOCR, recognition only); the shipped toy OCR model (polyrl/assets/toy_text)."""

from __future__ import annotations

import json
import math

import pytest

from polyrl.cli.main import main
from polyrl.config import ASSETS, load_config
from polyrl.toy import text_task


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out, prompts = tmp_path_factory.mktemp("toy_text"), tmp_path_factory.mktemp("text_prompts")
    args = ["pretrain-toy", "--task", "text", "--out", str(out), "--prompts-dir", str(prompts), "--vae-steps", "2",
            "--vae-batch", "2", "--steps", "2", "--batch", "4", "--num-images", "8", "--eval-samples", "2",
            "--threads", "1"]
    assert main(args) == 0
    return out, prompts


def test_pretrain_writes_a_diffusers_sd3_directory_with_its_record(pretrained):
    out, prompts = pretrained
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    record = json.loads((out / "pretrain.json").read_text())
    assert record["task"] == "text" and record["steps"] == 2 and record["num_images"] == 8
    assert record["command"].startswith("polyrl pretrain-toy --task text --vae-steps 2 --steps 2")
    assert (record["height"], record["width"]) == (text_task.HEIGHT, text_task.WIDTH)
    assert 0.0 <= record["heldout_ocr"] <= 1.0 and math.isfinite(record["losses"]["flow_final"])
    assert {"vae", "encode", "flow", "eval", "total"} <= set(record["seconds"])
    held = {json.loads(line)["text"] for line in (prompts / "text_heldout.jsonl").read_text().splitlines()}
    assert held == set(text_task.split_words()[1])
    tokenizer = json.loads((out / "tokenizer" / "tokenizer.json").read_text())
    assert set(text_task.TEXT_LETTERS) <= set(tokenizer["model"]["vocab"])  # letter-level: held-out words are known


def test_pretrain_init_continues_a_model_keeping_its_vae(pretrained, tmp_path):
    out, _ = pretrained
    args = ["pretrain-toy", "--task", "text", "--init", str(out), "--out", str(tmp_path / "more"), "--prompts-dir",
            str(tmp_path / "p"), "--steps", "1", "--batch", "2", "--num-images", "4", "--eval-samples", "0"]
    assert main(args) == 0
    record = json.loads((tmp_path / "more" / "pretrain.json").read_text())
    assert record["vae_steps"] == 0 and record["steps"] == 1 and record["continued_from"]["steps"] == 2
    assert f"--init {out}" in record["command"] and record["heldout_ocr"] is None
    vae_before = json.loads((out / "vae" / "config.json").read_text())
    vae_after = json.loads((tmp_path / "more" / "vae" / "config.json").read_text())
    assert (vae_after["shift_factor"], vae_after["scaling_factor"]) == (vae_before["shift_factor"],
                                                                         vae_before["scaling_factor"])


@pytest.mark.parametrize("recipe", ["toy_ocr", "toy_ocr_nft"])
def test_toy_ocr_recipe_trains_two_steps_with_the_real_ocr(pretrained, tmp_path, recipe):
    out, prompts = pretrained
    cfg = load_config([f"recipe={recipe}"])
    assert cfg.reward.name == "ocr" and cfg.reward.detect is False
    assert cfg.algorithm.name == {"toy_ocr": "flow_grpo", "toy_ocr_nft": "diffusion_nft"}[recipe]
    assert (cfg.rollout.height, cfg.rollout.width) == (text_task.HEIGHT, text_task.WIDTH)
    run = tmp_path / "run"
    args = ["train", f"recipe={recipe}", f"model.path={out}", f"data.path={prompts / 'text_train.jsonl'}",
            f"data.heldout_path={prompts / 'text_heldout.jsonl'}", f"trainer.output_dir={run}", "trainer.max_steps=2",
            "trainer.eval_every=2", "trainer.eval_samples=4", "trainer.num_validation=4", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "rollout.num_steps=4", "rollout.n=2",
            "rollout.batch_size=4", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]",
            "data.prompts_per_step=2", "actor.num_minibatches=1"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["loss"]) for r in rows[1:])
    assert "reward_extra/ocr/exact" in rows[-1] and "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[-1]
    assert (run / "samples" / "step_000002.png").is_file()
    # the held-out samples (and the grid's tiles) are captioned with the target word and what the OCR read
    samples = [json.loads(line) for line in (run / "samples" / "step_000002.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        word = s["prompt"].split('"')[1]
        assert s["caption"].startswith(f"target {word!r}, read '") and s["caption"].endswith("'"), s
    assert (run / "checkpoints" / "step_000002" / "adapter_model.safetensors").is_file()


def test_shipped_text_model_is_small_and_its_record_honest():
    """The shipped toy OCR model: a diffusers directory of at most 15 MB, trained by the recorded commands (on the
    CPU, then continued on a GPU), whose ODE samples on held-out words score here, on the CPU, what its pretrain.json
    says (16 of the 160 words here; all 160 gave 0.539 on the CPU against the recorded 0.536)."""
    from polyrl.toy.pretrain.text import evaluate_text

    root = ASSETS / "toy_text"
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) <= 15 * 2**20
    record = json.loads((root / "pretrain.json").read_text())
    assert record["task"] == "text" and record["command"].startswith("polyrl pretrain-toy --task text")
    # imperfect on purpose (issue 39): legible often, wrong often, so that RL has room
    assert record["eval_samples"] == 160 and 0.2 <= record["heldout_ocr"] <= 0.7
    rows = text_task.make_prompts(text_task.split_words()[1])[::10]
    result = evaluate_text(root, rows)
    assert abs(result["score"] - record["heldout_ocr"]) < 0.15, (result["score"], record["heldout_ocr"])
