"""Tests of group advantages (polyrl/algorithms/advantage.py, docs/algorithms.md §2) against per-group numpy loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl.algorithms.advantage import STD_MODES, group_advantages, zero_std_ratio


def ref_advantages(rewards, group_ids, std="global", clip=5.0, eps=1e-4):
    """Float64 per-group loop; stds are population stds (ddof=0)."""
    r = np.asarray(rewards, np.float64)
    ids = np.asarray(group_ids)
    out = np.empty_like(r)
    global_std = r.std(ddof=0)
    for g in set(ids.tolist()):
        members = [i for i in range(len(r)) if ids[i] == g]
        vals = r[members]
        m = sum(vals) / len(vals)
        if std == "global":
            denom = global_std + eps
        elif std == "group":
            denom = np.sqrt(sum((vals - m) ** 2) / len(vals)) + eps
        else:
            denom = 1.0
        for i in members:
            out[i] = min(max((r[i] - m) / denom, -clip), clip)
    return out


def rand_rewards(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).normal(size=n))


@pytest.mark.parametrize("std", STD_MODES)
def test_matches_reference_contiguous_groups(std):
    rewards = rand_rewards(24, 0)
    ids = torch.arange(6).repeat_interleave(4)
    out = group_advantages(rewards, ids, std=std)
    np.testing.assert_allclose(out.numpy(), ref_advantages(rewards.numpy(), ids.numpy(), std), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("std", STD_MODES)
def test_noncontiguous_unsorted_group_ids(std):
    ids = torch.tensor([7, 3, 7, 100, 3, 100, 7, 3, 100, 42, 42, 42])
    rewards = rand_rewards(len(ids), 1) * 3 + 1
    out = group_advantages(rewards, ids, std=std)
    np.testing.assert_allclose(out.numpy(), ref_advantages(rewards.numpy(), ids.numpy(), std), rtol=1e-12, atol=1e-12)
    # a permutation of the batch permutes the advantages
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    out_p = group_advantages(rewards[perm], ids[perm], std=std)
    np.testing.assert_allclose(out_p.numpy(), out[perm].numpy(), rtol=1e-12, atol=1e-12)


def test_hand_values_global_group_none():
    # two groups: [1, 3] (mean 2) and [0, 4] (mean 2)
    rewards = torch.tensor([1.0, 3.0, 0.0, 4.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    # global population std of {1, 3, 0, 4}: mean 2, var (1 + 1 + 4 + 4)/4 = 2.5
    g = np.sqrt(2.5) + 1e-4
    np.testing.assert_allclose(group_advantages(rewards, ids, "global").numpy(), [-1 / g, 1 / g, -2 / g, 2 / g],
                               rtol=1e-12)
    # group population stds: 1 and 2
    np.testing.assert_allclose(group_advantages(rewards, ids, "group").numpy(),
                               [-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001], rtol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards, ids, "none").numpy(), [-1, 1, -2, 2], rtol=0, atol=0)


def test_population_not_sample_std():
    rewards = torch.tensor([0.0, 2.0], dtype=torch.float64)  # population std 1, sample std sqrt(2)
    out = group_advantages(rewards, torch.tensor([0, 0]), "group")
    np.testing.assert_allclose(out.numpy(), [-1 / 1.0001, 1 / 1.0001], rtol=1e-12)


def test_eps_is_1e_minus_4():
    # tiny reward spread: std 1e-3, so eps changes the result by 10%
    rewards = torch.tensor([0.0, 0.002], dtype=torch.float64)
    out = group_advantages(rewards, torch.tensor([5, 5]), "group")
    np.testing.assert_allclose(out.numpy(), [-0.001 / 0.0011, 0.001 / 0.0011], rtol=1e-10)
    out = group_advantages(rewards, torch.tensor([5, 5]), "global", eps=0.0)
    np.testing.assert_allclose(out.numpy(), [-1.0, 1.0], rtol=1e-10)


def test_constant_group_gives_zero_not_nan():
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.9], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1])
    for std in STD_MODES:
        out = group_advantages(rewards, ids, std)
        assert torch.isfinite(out).all()
        assert torch.equal(out[:3], torch.zeros(3, dtype=torch.float64))
    # all rewards identical: global std 0 -> divide by eps only, still 0
    out = group_advantages(torch.ones(4, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), "global")
    assert torch.equal(out, torch.zeros(4, dtype=torch.float64))


def test_clamp_default_5():
    # one outlier in a group of 64: group z-score sqrt(63) ≈ 7.94 > 5
    rewards = torch.zeros(64, dtype=torch.float64)
    rewards[10] = 1.0
    out = group_advantages(rewards, torch.zeros(64, dtype=torch.long), "group")
    assert out[10].item() == 5.0
    ref = ref_advantages(rewards.numpy(), np.zeros(64), "group")
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12, atol=1e-12)
    assert out.min().item() > -5.0  # the other members are -1/63 / std, not clamped


@pytest.mark.parametrize("std", STD_MODES)
def test_clamp_custom_both_sides(std):
    rewards = torch.tensor([-10.0, 0.0, 10.0, 3.0, -3.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    out = group_advantages(rewards, ids, std, clip=0.5)
    assert out.max().item() == 0.5 and out.min().item() == -0.5
    np.testing.assert_allclose(out.numpy(), ref_advantages(rewards.numpy(), ids.numpy(), std, clip=0.5),
                               rtol=1e-12, atol=1e-12)


def test_keeps_input_dtype():
    rewards = rand_rewards(8, 2).float()
    out = group_advantages(rewards, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), "global")
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref_advantages(rewards.numpy(), [0, 0, 1, 1, 2, 2, 3, 3]), rtol=1e-6)


def test_bad_mode_raises_with_allowed_values():
    with pytest.raises(ValueError, match="global, group, none") as e:
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std="batch")
    assert "batch" in str(e.value)


def test_zero_std_ratio():
    rewards = torch.tensor([1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 0.0, 5.0])
    ids = torch.tensor([4, 4, 9, 9, 2, 2, 2, 6, 6])  # groups: {4: 1,1} {9: 1,2} {2: 3,3,3} {6: 0,5}
    assert zero_std_ratio(rewards, ids) == pytest.approx(2 / 4)
    assert zero_std_ratio(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])) == 0.0
    assert zero_std_ratio(torch.tensor([1.0, 1.0, 7.0, 7.0]), torch.tensor([1, 1, 0, 0])) == 1.0
