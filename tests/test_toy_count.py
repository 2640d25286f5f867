"""The toy text task (toy/count_task.py), its pretraining command and the shipped model (polyrl/assets/toy_count)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import ASSETS, load_config
from polyrl.toy import count_task
from polyrl.toy.count_task import Group, Scene


def test_scene_text_and_answers():
    scene = Scene((Group("red", "circle", 2), Group("blue", "square", 1), Group("green", "circle", 3)),
                  ("shape", "circle"))
    assert scene.text() == "two red circles , a blue square and three green circles . how many circles ?"
    assert scene.answer() == 5
    assert Scene(scene.groups, ("color", "red")).answer() == 2
    assert Scene(scene.groups, ("color", "yellow")).answer() == 0
    assert Scene(scene.groups, ("all", None)).answer() == 6
    assert Scene(scene.groups[:1], ("all", None)).text() == "two red circles . how many shapes ?"


def test_vocabulary_covers_every_scene_and_answer():
    vocab = set(count_task.vocabulary())
    rng = random.Random(0)
    for _ in range(500):
        s = count_task.random_scene(rng)
        assert set(s.text().split()) <= vocab
        assert str(s.answer()) in vocab and 0 <= s.answer() <= count_task.MAX_ANSWER


def test_prompt_files_hold_answers_and_disjoint_heldout(tmp_path):
    train, heldout = count_task.make_prompts(tmp_path, n_train=300, n_heldout=100, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    held = [json.loads(line) for line in heldout.read_text().splitlines()]
    assert len(rows) == 300 and len(held) == 100
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    assert all(set(r) == {"prompt", "answer"} and r["answer"].isdigit() for r in rows + held)


def test_shipped_prompt_files_and_recipe():
    cfg = load_config(["recipe=toy_count"])
    assert cfg.model.name == "causal_lm" and cfg.algorithm.name == "grpo" and cfg.reward.name == "math_answer"
    held = {json.loads(line)["prompt"] for line in open(cfg.data.heldout_path)}
    train = {json.loads(line)["prompt"] for line in open(cfg.data.path)}
    assert len(held) >= 64 and not held & train
    for algo in ("dapo", "gspo"):  # the recipe sets no algorithm key: each loss keeps its own defaults
        assert load_config(["recipe=toy_count", f"algorithm={algo}"]).algorithm.name == algo


def test_shipped_model_loads_and_counts(tmp_path):
    from polyrl.models.causal_lm import CausalLMPolicy

    path = ASSETS / "toy_count"
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size <= 5 * 2**20, f"{size / 2**20:.1f} MB"
    meta = json.loads((path / "pretrain.json").read_text())
    assert meta["task"] == "count" and 0.2 < meta["heldout_accuracy"] < 0.9  # partly able: room to learn
    adapter = CausalLMPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=64),
                             torch.device("cpu"))
    assert not adapter.chat  # raw prompts
    ids = adapter.encode_prompts(["a red circle . how many circles ?"])[0][0]
    assert adapter.tokenizer.convert_ids_to_tokens(ids) == "a red circle . how many circles ?".split()  # a word a token
    assert adapter.decode([adapter.tokenizer("12", add_special_tokens=False).input_ids]) == ["12"]


def test_pretrain_toy_count_command(tmp_path):
    out, prompts = tmp_path / "model", tmp_path / "prompts"
    assert main(["pretrain-toy", "--task", "count", "--steps", "3", "--out", str(out), "--prompts-dir", str(prompts),
                 "--eval-samples", "8"]) == 0
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["steps"] == 3 and meta["eval_samples"] == 8 and 0 <= meta["heldout_accuracy"] <= 1
    assert (prompts / "count_train.jsonl").is_file() and (prompts / "count_heldout.jsonl").is_file()
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen3ForCausalLM"


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo"])
def test_toy_count_recipe_trains(tmp_path, algorithm):
    out = tmp_path / "run"
    assert main(["train", "recipe=toy_count", f"algorithm={algorithm}", f"trainer.output_dir={out}",
                 "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_samples=16", "trainer.save_every=0",
                 "trainer.progress=false", "trainer.tensorboard=false", "data.prompts_per_step=4"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/reward_mean" in rows[-1]
