"""Paired evaluation statistics (polyrl/evaluation/stats.py) against hand computations, and the reward-hacking watch
(polyrl/evaluation/hacking.py) on synthetic histories."""

import math

import numpy as np
import pytest

from polyrl.evaluation.hacking import alarm_line, hacking_alarm, history_entry
from polyrl.evaluation.stats import bootstrap_ci95, summarize, summarize_by_category, win_rate

# 3 prompts x 2 samples, checkpoint and base from the same noise
CKPT = [[1.0, 0.0], [0.5, 0.5], [1.0, 1.0]]
BASE = [[0.0, 0.0], [0.5, 1.0], [1.0, 0.0]]


def percentile_linear(values, q):
    """numpy's default percentile by hand: rank q/100·(n−1) in the sorted values, linearly interpolated."""
    s = sorted(values)
    r = q / 100 * (len(s) - 1)
    lo = math.floor(r)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (r - lo)


def test_paired_summary_by_hand():
    out = summarize(CKPT, seed=0, resamples=200, base=BASE)
    # prompt means: ckpt 0.5, 0.5, 1.0 -> 2/3; base 0.0, 0.75, 0.5 -> 5/12; delta 0.5, -0.25, 0.5 -> 0.25
    assert out["mean"] == pytest.approx(2 / 3, abs=1e-12)
    assert out["base_mean"] == pytest.approx(5 / 12, abs=1e-12)
    assert out["delta"] == pytest.approx(0.25, abs=1e-12)
    # samples: (1>0 win) (0=0 tie) (0.5=0.5 tie) (0.5<1 loss) (1=1 tie) (1>0 win): (2 + 3/2) / 6
    assert out["win_rate"] == pytest.approx(3.5 / 6, abs=1e-12)
    assert out["prompts"] == 3 and out["samples"] == 6
    # the bootstrap by hand: the same seeded draws, each resample's mean in a loop, percentiles by hand
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 3, size=(200, 3))
    d = [0.5, -0.25, 0.5]
    means = [sum(d[i] for i in row) / 3 for row in idx.tolist()]
    assert out["delta_ci95"] == pytest.approx([percentile_linear(means, 2.5), percentile_linear(means, 97.5)],
                                              abs=1e-12)
    m = [0.5, 0.5, 1.0]
    means = [sum(m[i] for i in row) / 3 for row in idx.tolist()]
    assert out["ci95"] == pytest.approx([percentile_linear(means, 2.5), percentile_linear(means, 97.5)], abs=1e-12)
    assert out["ci95"][0] <= out["mean"] <= out["ci95"][1]


def test_identical_scores_have_zero_delta_and_half_win_rate():
    out = summarize(CKPT, seed=3, base=CKPT)
    assert out["delta"] == 0.0 and out["delta_ci95"] == [0.0, 0.0] and out["win_rate"] == 0.5
    assert bootstrap_ci95([0.7, 0.7, 0.7], seed=1) == pytest.approx([0.7, 0.7], abs=1e-15)


def test_categories_and_their_mean():
    out = summarize_by_category(CKPT, ["a", "b", "a"], seed=0, resamples=50, base=BASE)
    a, b = out["categories"]["a"], out["categories"]["b"]
    assert a["mean"] == pytest.approx(0.75) and a["delta"] == pytest.approx(0.5) and a["prompts"] == 2
    assert b["mean"] == pytest.approx(0.5) and b["delta"] == pytest.approx(-0.25) and b["samples"] == 2
    assert out["category_mean"] == pytest.approx((0.75 + 0.5) / 2)
    assert out["category_delta"] == pytest.approx((0.5 - 0.25) / 2)
    assert "categories" not in summarize_by_category(CKPT, [None] * 3, seed=0)


def test_shape_errors():
    with pytest.raises(ValueError, match="paired scores differ in shape"):
        win_rate(CKPT, [[1.0]])
    with pytest.raises(ValueError, match="2 categories for 3 prompts"):
        summarize_by_category(CKPT, ["a", "b"], seed=0)


def evaluation(step, reward, other, h=0.02):
    return {"step": step, "means": {"shapes": reward, "pickscore": other},
            "ci95": {"shapes": [reward - h, reward + h], "pickscore": [other - h, other + h]}}


def test_hacking_alarm_fires_when_reward_rises_and_another_scorer_falls():
    history = [evaluation(0, 0.50, 0.80), evaluation(10, 0.60, 0.78), evaluation(20, 0.70, 0.70)]
    fallen = hacking_alarm(history, "shapes")
    assert [f["scorer"] for f in fallen] == ["pickscore"]
    assert fallen[0]["drop"] == pytest.approx(0.10) and fallen[0]["noise"] == pytest.approx(math.hypot(0.02, 0.02))
    assert alarm_line(fallen, "shapes").startswith("polyrl: warning: possible reward hacking at step 20: held-out "
                                                   "shapes rose 0.5000 -> 0.7000 while pickscore 0.8000 -> 0.7000")
    # a fall within the noise, or a reward that did not rise, is no alarm
    assert hacking_alarm([evaluation(0, 0.5, 0.80), evaluation(20, 0.7, 0.78)], "shapes") == []
    assert hacking_alarm([evaluation(0, 0.5, 0.80), evaluation(20, 0.5, 0.60)], "shapes") == []
    assert hacking_alarm([evaluation(0, 0.5, 0.80)], "shapes") == []


def test_hacking_alarm_quiet_on_noise():
    """Both scorers pure noise around fixed means (64 prompts, bootstrap ci95 from the samples), the reward drifting
    up a little: the alarm stays quiet in nearly every run."""
    alarms = 0
    for trial in range(200):
        rng = np.random.default_rng(trial)
        history = []
        for step in range(4):
            reward = 0.5 + 0.01 * step + 0.1 * rng.standard_normal(64)
            other = 0.8 + 0.1 * rng.standard_normal(64)
            history.append({"step": step, "means": {"r": reward.mean(), "o": other.mean()},
                            "ci95": {"r": bootstrap_ci95(reward, 0, 200), "o": bootstrap_ci95(other, 0, 200)}})
        alarms += bool(hacking_alarm(history, "r"))
    assert alarms <= 10  # ~2.5% expected when the reward rises; never more than 5%


def test_history_entry_groups_samples_by_prompt():
    """Samples of uneven prompts (a held-out set cycled over its rows): the prompt means are the unit."""
    entry = history_entry(10, {"r": [1.0, 0.0, 0.0]}, ["a", "a", "b"], seed=0, resamples=100)
    assert entry["step"] == 10
    assert entry["means"]["r"] == pytest.approx((0.5 + 0.0) / 2)  # not 1/3, the sample mean
    assert entry["ci95"]["r"] == bootstrap_ci95([0.5, 0.0], 0, 100)
    with pytest.raises(ValueError, match="2 r scores for 3 samples"):
        history_entry(0, {"r": [1.0, 0.0]}, ["a", "a", "b"], seed=0)
