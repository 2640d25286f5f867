"""reward=mix's per-component normalisation (none, running mean/std, rank within the group) against float64 loops,
each component's part of the advantage against group_advantages, and the running statistics kept across a resume."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from polyrl.algorithms.advantage import advantage_parts, group_advantages, part_metrics
from polyrl.cli.main import main
from polyrl.rewards import REWARDS, RewardOutput, build_reward, call_reward
from polyrl.rewards.mix import group_ranks, merge_stats, mix_terms, reward_terms
from polyrl.trainer.checkpoint import read_checkpoint


class _Given:
    """Scores given per call: `queue` is consumed one list per call."""

    queue: list = []

    def __init__(self, tag: str = ""):
        self.tag = tag

    def __call__(self, images, prompts, metadata):
        return RewardOutput(torch.tensor(_Given.queue.pop(0), dtype=torch.float32))


@pytest.fixture
def given(monkeypatch):
    monkeypatch.setitem(REWARDS, "_given", _Given)
    _Given.queue = []
    return _Given


def _rank_loop(scores, groups):
    out = [math.nan] * len(scores)
    for g in set(groups):
        idx = [i for i in range(len(scores)) if groups[i] == g and not math.isnan(scores[i])]
        for i in idx:
            below = sum(scores[j] < scores[i] for j in idx)
            ties = sum(scores[j] == scores[i] for j in idx) - 1
            out[i] = 0.5 if len(idx) == 1 else (below + ties / 2) / (len(idx) - 1)
    return out


def test_group_ranks_against_a_loop():
    scores = [0.3, 0.1, 0.3, math.nan, 2.0, -1.0, 5.0, 5.0, 7.0]
    groups = [0, 0, 0, 0, 1, 1, 2, 2, 3]
    got = group_ranks(torch.tensor(scores, dtype=torch.float64), torch.tensor(groups)).tolist()
    ref = _rank_loop(scores, groups)
    assert [math.isnan(x) for x in got] == [math.isnan(x) for x in ref]
    assert [x for x in got if not math.isnan(x)] == pytest.approx([x for x in ref if not math.isnan(x)], abs=0)
    assert got[:3] == [0.75, 0.0, 0.75] and got[8] == 0.5  # ties share their mean rank; a group of one: 0.5


def test_running_statistics_merge_like_one_pass():
    rng = np.random.default_rng(0)
    parts = [rng.normal(3, 2, size=k) for k in (5, 1, 17, 8)]
    stats = None
    for p in parts:
        stats = merge_stats(stats, torch.tensor(p))
    allv = np.concatenate(parts)
    assert stats[0] == len(allv) and stats[1] == pytest.approx(allv.mean(), rel=1e-12)
    assert stats[2] == pytest.approx(((allv - allv.mean()) ** 2).sum(), rel=1e-12)


def test_running_normalisation_uses_earlier_training_steps_only(given):
    mix = build_reward({"name": "mix", "normalize": "running", "mix": {"a": {"reward": "_given", "weight": 2.0}}})
    imgs = torch.zeros(3, 3, 4, 4)
    # outside training (and at the first step): the call's own scores
    given.queue = [[1.0, 2.0, 6.0]]
    z = mix(imgs, ["p"] * 3, None).extras["reward/a/normalized"]
    ref = np.array([1.0, 2.0, 6.0])
    assert z == pytest.approx(((ref - ref.mean()) / ref.std()).tolist(), rel=1e-12)
    # a training step: recorded, joins the statistics once it has trained; an evaluation's scores never do
    mix.begin_step(train=True)
    given.queue = [[1.0, 2.0], [6.0]]  # two chunks of one step (reward.async)
    mix(imgs[:2], ["p"] * 2, None)
    mix(imgs[:1], ["p"], None)
    assert mix.running_stats == {}  # not before the step has trained
    mix.end_step()
    mix.begin_step(train=False)
    given.queue = [[100.0, -50.0, 3.0]]
    out = mix(imgs, ["p"] * 3, None)
    mix.end_step()
    mu, sd = ref.mean(), ref.std()
    assert out.extras["reward/a/normalized"] == pytest.approx(((np.array([100.0, -50.0, 3.0]) - mu) / sd).tolist())
    assert out.scores.tolist() == pytest.approx((2.0 * (np.array([100.0, -50.0, 3.0]) - mu) / sd).tolist(), rel=1e-6)
    assert mix.running_stats["a"][0] == 3  # the evaluation was not recorded
    state = json.loads(json.dumps(mix.reward_state()))  # plain numbers: what trainer_state.pt keeps
    other = build_reward({"name": "mix", "normalize": "running", "mix": {"a": {"reward": "_given", "weight": 2.0}}})
    other.load_reward_state(state)
    assert other.running_stats == mix.running_stats
    # a component that never varied: centred, not divided
    flat = build_reward({"name": "mix", "mix": {"a": {"reward": "_given", "weight": 1.0, "normalize": "running"}}})
    given.queue = [[4.0, 4.0]]
    assert flat(imgs[:2], ["p"] * 2, None).scores.tolist() == [0.0, 0.0]


def test_rank_normalisation_makes_the_mix_a_group_reward(given):
    mix = build_reward({"name": "mix", "mix": {"a": {"reward": "_given", "weight": 1.0, "normalize": "rank"},
                                               "b": {"reward": "_given", "weight": 0.5}}})
    assert mix.groupwise
    given.queue = [[10.0, 30.0, 20.0, 5.0], [1.0, 2.0, 3.0, 4.0]]
    out = call_reward(mix, torch.zeros(4, 3, 4, 4), ["p"] * 4, [{}] * 4, group_ids=torch.tensor([0, 0, 0, 1]))
    ranks = _rank_loop([10.0, 30.0, 20.0, 5.0], [0, 0, 0, 1])
    assert out.extras["reward/a/normalized"] == ranks
    assert out.scores.tolist() == pytest.approx([r + 0.5 * b for r, b in zip(ranks, [1, 2, 3, 4], strict=True)])
    terms = [out.extras["reward/a/term"], out.extras["reward/b/term"]]
    assert [a + b for a, b in zip(*terms, strict=True)] == pytest.approx(out.scores.tolist())
    with pytest.raises(ValueError, match=r"reward.mix.a.normalize='zscore' is not valid; allowed: none, running, rank"):
        build_reward({"name": "mix", "mix": {"a": {"reward": "_given", "weight": 1.0, "normalize": "zscore"}}})


def test_terms_sum_to_the_mix_when_a_component_failed():
    z = torch.tensor([[1.0, 2.0, math.nan], [0.5, math.nan, math.nan]], dtype=torch.float64)
    w = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    t = mix_terms(z, w)
    # row 0: c0, c1 scored, weight 0.8 spread to 1.0; row 1: only c0
    assert t.flatten().tolist() == pytest.approx([0.5 * 1.0 / 0.8, 0.3 * 2.0 / 0.8, 0.0, 0.5 * 0.5 / 0.5, 0.0, 0.0])
    labels, got = reward_terms({"reward/x/term": [1.0, None], "reward/x": [3.0, 4.0], "reward/y/term": [2.0, 3.0]}, 2)
    assert labels == ["x", "y"] and got.tolist() == [[1.0, 2.0], [0.0, 3.0]]


@pytest.mark.parametrize("std", ["global", "group", "none"])
def test_advantage_parts_sum_to_the_advantage(std):
    gen = torch.Generator().manual_seed(0)
    terms = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    groups = torch.arange(4).repeat_interleave(3)
    rewards = terms.sum(1)
    parts = advantage_parts(terms, rewards, groups, std)
    adv = group_advantages(rewards, groups, std, clip=1e9)
    assert parts.sum(1).tolist() == pytest.approx(adv.tolist(), abs=1e-12)
    # against a loop: (t_ic − mean of its group's t_c) / the divisor group_advantages used
    for i in range(12):
        members = [j for j in range(12) if groups[j] == groups[i]]
        centred_r = float(rewards[i] - rewards[members].mean())
        for c in range(3):
            centred = float(terms[i, c] - terms[members, c].mean())
            if std == "none":
                assert parts[i, c] == pytest.approx(centred, abs=1e-12)
            elif abs(centred_r) > 1e-9:
                assert parts[i, c] == pytest.approx(centred * float(adv[i]) / centred_r, rel=1e-9)
    m = part_metrics(["a", "b", "c"], parts)
    assert sum(m[f"adv/share/{k}"] for k in "abc") == pytest.approx(1.0)
    assert m["adv/part/b"] == pytest.approx(float(parts[:, 1].abs().mean()))


def _train_args(model_dir, prompts, out, steps, extra=()):
    mix = ("{jpeg_incompressibility: {weight: 1.0, normalize: rank}, "
           "jpeg_compressibility: {weight: 0.5, normalize: running}}")
    return ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3",
            "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=2", "model.max_sequence_length=16",
            "rollout.guidance_scale=2.0", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=1",
            "trainer.deterministic=true", "reward=mix", f"reward.mix={mix}", "reward.async=true", *extra]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_each_components_part_and_resumes_with_its_statistics(tiny_sd3_dir, shape_prompts_file,
                                                                         tmp_path):
    """2 steps: the log has each component's part of the advantage (the shares sum to 1); the checkpoint keeps
    jpeg's running statistics (count and mean are those of the logged steps); a run resumed from step 1 trains
    step 2 as the uninterrupted run did (its jpeg term is normalised by step 1's statistics)."""
    a = tmp_path / "a"
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, a, 2)) == 0
    rows = _metrics(a)
    for m in rows:
        assert m["adv/share/jpeg_incompressibility"] + m["adv/share/jpeg_compressibility"] == pytest.approx(1.0)
        assert m["adv/part/jpeg_incompressibility"] > 0 and m["adv/part/jpeg_compressibility"] > 0
    stats = read_checkpoint(a / "checkpoints" / "step_000002")["reward"]["running_stats"]
    count, mean, _ = stats["jpeg_compressibility"]
    assert count == 8 and mean == pytest.approx(np.mean([m["reward/jpeg_compressibility"] for m in rows]), rel=1e-6)
    assert "jpeg_incompressibility" not in stats  # rank keeps no statistics
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_000002")
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, b, 2, ["trainer.resume=auto"])) == 0
    resumed = [m for m in _metrics(b) if m["step"] == 2][-1]
    assert resumed["reward/mean"] == pytest.approx(rows[1]["reward/mean"], rel=1e-5)
    assert resumed["reward/jpeg_compressibility/term"] == pytest.approx(rows[1]["reward/jpeg_compressibility/term"],
                                                                         rel=1e-5, abs=1e-6)
