"""The toy prompt rewriter (toy/rewrite_task.py, `polyrl pretrain-toy --task rewrite`, polyrl/assets/toy_rewriter,
recipe=toy_rewriter): the careless annotator's rewrites, the shipped model and its recorded room to learn, and the
learning table's command (docs/tokens.md, "Prompt rewriter") run for 2 steps on the shipped assets, whose held-out
samples show request, rewrite and image."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import ASSETS, load_config
from polyrl.toy import rewrite_task
from polyrl.toy.shapes_task import ObjectGroup, ShapesSpec, parse_prompt

SPEC = ShapesSpec((ObjectGroup("red", "circle", 2), ObjectGroup("blue", "square", 1)), "above")


def test_rewrites_follow_their_rates_and_use_the_vocabulary():
    rng, vocab, n = random.Random(0), set(rewrite_task.vocabulary()), 4000
    texts = [rewrite_task.rewrite(SPEC, rng) for _ in range(n)]
    assert all(set(t.split()) <= vocab for t in texts)
    first = Counter(t.split()[0] for t in texts)
    assert abs(first["please"] / n - rewrite_task.P_FILLER) < 0.03  # the single most likely first word
    assert first["please"] > max(c for w, c in first.items() if w != "please")
    assert abs(sum(" and " in t for t in texts) / n - rewrite_task.P_AND) < 0.03
    faithful = {SPEC.text(), "a blue square below two red circles"}  # the request, and its reordering
    kept = [t for t in texts if t in faithful]
    expected = (1 - rewrite_task.P_FILLER) * (1 - rewrite_task.P_AND) * (1 - rewrite_task.P_RECOLOR) ** 2 \
        * (1 - rewrite_task.P_SINGULAR)
    assert abs(len(kept) / n - expected) < 0.02
    assert all(parse_prompt(t) in (SPEC, ShapesSpec(SPEC.groups[::-1], "below")) for t in kept)
    single = ShapesSpec((ObjectGroup("green", "triangle", 3),))
    bodies = Counter(" ".join(rewrite_task.rewrite(single, rng).split()[-3:]) for _ in range(1000))
    assert bodies.most_common(1)[0][0] == "three green triangles" and "three green triangle" in bodies
    assert all(b.startswith("three ") and b.split()[2] in ("triangle", "triangles") for b in bodies)


def test_recipe_composes_on_the_shipped_assets():
    cfg = load_config(["recipe=toy_rewriter"])
    assert (cfg.model.name, cfg.algorithm.name, cfg.reward.name) == ("causal_lm", "grpo", "rewrite_render")
    assert cfg.model.path == str(ASSETS / "toy_rewriter") and cfg.reward.generator.path == str(ASSETS / "toy_shapes")
    assert cfg.reward.scorer.name == "shapes" and cfg.data.heldout_path.endswith("shapes_heldout.jsonl")
    held = {json.loads(line)["prompt"] for line in open(cfg.data.heldout_path)}
    train = {json.loads(line)["prompt"] for line in open(cfg.data.path)}
    assert len(held) >= cfg.trainer.eval_samples and not held & train


def test_shipped_rewriter_loads_and_has_room_to_learn():
    from polyrl.models.causal_lm import CausalLMPolicy

    path = ASSETS / "toy_rewriter"
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size <= 5 * 2**20, f"{size / 2**20:.1f} MB"
    meta = json.loads((path / "pretrain.json").read_text())
    rewards = meta["heldout_shapes_reward"]
    assert meta["task"] == "rewrite" and rewards["greedy"] < rewards["requests"] - 0.2  # room above the base
    adapter = CausalLMPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=32),
                             torch.device("cpu"))
    assert adapter.chat  # the request is one ChatML user message
    ids = adapter.encode_prompts([SPEC.text()])[0][0]
    tokens = adapter.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:2] == ["<|im_start|>", "user"] and SPEC.text().split() == tokens[2:2 + 7]
    assert "<unk>" not in tokens


def test_pretrain_toy_rewrite_command_and_its_evaluation(tmp_path):
    from polyrl.toy.pretrain.rewrite import rewrite_rewards

    out = tmp_path / "model"
    assert main(["pretrain-toy", "--task", "rewrite", "--steps", "2", "--out", str(out), "--eval-samples", "0"]) == 0
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["steps"] == 2 and meta["task"] == "rewrite" and meta["heldout_shapes_reward"] is None
    assert len(meta["loss_curve"]) == 2 and all(v > 0 for v in meta["loss_curve"])
    # the evaluation pretrain.json records, on 3 held-out requests with cheap renders
    rewards = rewrite_rewards(out, ASSETS / "prompts" / "shapes_heldout.jsonl", n=3,
                              render={"height": 64, "width": 64, "num_steps": 2})
    assert set(rewards) == {"requests", "greedy", "sampled", "greedy_filler_share", "greedy_examples"}
    assert all(0 <= rewards[k] <= 1 for k in ("requests", "greedy", "sampled", "greedy_filler_share"))
    held = [json.loads(line)["prompt"] for line in (ASSETS / "prompts" / "shapes_heldout.jsonl").open()][:3]
    assert [e["request"] for e in rewards["greedy_examples"]] == held


@pytest.mark.parametrize("algorithm", ["grpo"])
def test_learning_table_command_runs_two_steps_and_writes_request_rewrite_image(tmp_path, algorithm):
    """The table's command (docs/tokens.md), cut to 2 steps of 2 requests and cheap renders."""
    out = tmp_path / "run"
    assert main(["train", "recipe=toy_rewriter", f"algorithm={algorithm}", f"trainer.output_dir={out}",
                 "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_samples=4", "trainer.num_validation=4",
                 "data.prompts_per_step=2", "rollout.n=4", "reward.rollout.num_steps=2", "trainer.progress=false",
                 "trainer.tensorboard=false", "trainer.device=cpu", "reward.device=cpu"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[-1]
    assert any(r.get("grad_norm", 0) > 0 for r in rows)
    samples = [json.loads(line) for line in (out / "samples" / "step_000002.jsonl").read_text().splitlines()]
    held = [json.loads(line)["prompt"] for line in (ASSETS / "prompts" / "shapes_heldout.jsonl").open()][:4]
    assert [s["prompt"] for s in samples] == held and all(isinstance(s["response"], str) for s in samples)
    assert all(s["caption"] == f"-> {s['response'].strip()}" for s in samples)  # the grid's line under the request
    from PIL import Image

    grid = Image.open(out / "samples" / "step_000002.png")  # the generator's renders of the rewrites
    assert grid.width == 4 * 64 * 2
