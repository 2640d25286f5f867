"""recipe=prompt_rewriter (rewards/rewrite_render.py): a token policy trained through a frozen generator. The generator's
weights are bit-identical after training steps and never trainable, the scorer sees the original request (and the
rewrite as metadata), renders are deterministic from noise fixed per request, and a 2-step CLI run trains the LM."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.config import ASSETS
from polyrl.rewards import REWARDS, RewardOutput, build_reward
from polyrl.rewards.rewrite_render import RewriteRender

GENERATOR = {"name": "sd3", "path": str(ASSETS / "toy_shapes")}
FAST = {"height": 32, "width": 32, "num_steps": 2}
SEEN: list = []  # (prompts, metadata) of every scorer call
BUILT: list = []  # every RewriteRender the runs built


class RecordingScorer:
    """An image scorer that records what it is asked and scores the mean pixel."""

    def __call__(self, images, prompts, metadata):
        SEEN.append((list(prompts), [dict(m) for m in metadata], images.shape))
        return RewardOutput(images.mean((1, 2, 3)))


class TrackedRewriteRender(RewriteRender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        BUILT.append(self)


REWARDS.setdefault("test_recording_scorer", RecordingScorer)
REWARDS.setdefault("test_tracked_rewrite_render", TrackedRewriteRender)


def _rows(n):
    return [json.loads(line) for line in (ASSETS / "prompts" / "shapes_train.jsonl").read_text().splitlines()[:n]]


def test_render_is_deterministic_per_request_and_scored_against_the_original():
    SEEN.clear()
    reward = build_reward({"name": "rewrite_render", "generator": GENERATOR, "rollout": FAST, "device": "cpu",
                           "scorer": {"name": "test_recording_scorer"}})
    assert all(not p.requires_grad for m in reward.generator.modules().values() for p in m.parameters())
    rows = _rows(2)
    prompts = [rows[0]["prompt"]] * 3 + [rows[1]["prompt"]]
    meta = [{"groups": rows[0]["groups"]}] * 3 + [{"groups": rows[1]["groups"]}]
    rewrites = ["a red circle", "a red circle", " two blue squares ", "a red circle"]
    out = reward(rewrites, prompts, meta)
    images = reward.last_media["images"]
    assert torch.equal(images[0], images[1])  # one request, one rewrite: the same image
    assert not torch.equal(images[0], images[2])  # one request (one noise), another rewrite
    assert not torch.equal(images[0], images[3])  # the same rewrite of another request: other noise
    again = reward(rewrites[:1], prompts[:1], meta[:1])
    # a render does not depend on its batch (up to the rounding of batched matmuls)
    torch.testing.assert_close(reward.last_media["images"][0], images[0], rtol=0, atol=1e-5)
    assert SEEN[0][0] == prompts  # the ORIGINAL requests, not the rewrites
    assert [m["rewrite"] for m in SEEN[0][1]] == ["a red circle", "a red circle", "two blue squares", "a red circle"]
    assert SEEN[0][1][0]["groups"] == rows[0]["groups"]
    torch.testing.assert_close(out.scores, images.mean((1, 2, 3)))
    assert out.extras["rewrite/words"] == [3.0, 3.0, 3.0, 3.0] and again.scores.shape == (1,)
    with pytest.raises(ValueError, match="reward.rollout: unknown key"):
        build_reward({"name": "rewrite_render", "generator": GENERATOR, "scorer": {"name": "shapes"},
                      "rollout": {"steps": 2}})
    with pytest.raises(ValueError, match="reward.generator must be a mapping with at least name and path"):
        build_reward({"name": "rewrite_render", "generator": {"name": "sd3"}, "scorer": {"name": "shapes"}})


def test_prompt_rewriter_recipe_trains_the_lm_and_leaves_the_generator_untouched(tiny_qwen3_dir, tmp_path):
    from polyrl.cli.main import main

    SEEN.clear()
    BUILT.clear()
    data = tmp_path / "requests.jsonl"
    rows = _rows(4)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["train", "recipe=prompt_rewriter", f"model.path={tiny_qwen3_dir}", f"data.path={data}",
            "data.heldout_path=null", "reward.name=test_tracked_rewrite_render",
            "reward.scorer={name: test_recording_scorer}", "reward.rollout.height=32", "reward.rollout.width=32",
            "reward.rollout.num_steps=2", "reward.device=cpu", "rollout.n=2", "data.prompts_per_step=2",
            "rollout.max_new_tokens=4", "rollout.batch_size=4", "actor.lora_rank=4", "actor.lora_alpha=8",
            "actor.lr=1e-2", "actor.num_minibatches=1", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.max_steps=2",
            f"trainer.output_dir={out}"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and any(m["grad_norm"] > 0 for m in metrics)
    originals = {r["prompt"] for r in rows}
    assert len(SEEN) >= 2 and all(set(p) <= originals for p, _, _ in SEEN)  # the scorer saw only the requests
    assert all("rewrite" in m for _, meta, _ in SEEN for m in meta)
    (reward,) = BUILT
    fresh = build_reward({"name": "rewrite_render", "generator": GENERATOR, "rollout": FAST, "device": "cpu",
                          "scorer": {"name": "test_recording_scorer"}}).generator
    for name, module in reward.generator.modules().items():
        assert not any(p.requires_grad for p in module.parameters()), name
        ref = fresh.modules()[name].state_dict()
        for k, v in module.state_dict().items():
            assert torch.equal(v, ref[k]), f"{name}.{k} changed"
