"""DGPO and AWM (docs/algorithms.md §3) against independent float64 transcriptions of Flow-Factory's formulas
(trainers/rl/dgpo.py, trainers/rl/awm.py, utils/noise_schedule.py), gradients included; the whole-group
mini-batches DGPO trains on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.actor.local import group_micro_batches, group_minibatches
from polyrl.algorithms.awm import awm_loss, matching_log_prob, matching_weighting
from polyrl.algorithms.dgpo import dgpo_clip_mask, dgpo_loss, dsm_error, ema_ref_decay, group_noise
from polyrl.algorithms.forward_process import discrete_sigma, noise_to, uniform_sigma
from polyrl.draws import UpdateDraws


def t64(a):
    return torch.as_tensor(np.asarray(a, np.float64))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------ DGPO
def ref_dgpo(err, ref_err, adv, groups, beta, clip):
    """Flow-Factory `_compute_group_dgpo_loss`, as loops: per group s = Σ A·β·(e − e_ref)/G, w = σ(s);
    loss = mean_i w·A·e; d loss / d e_i = w_i·A_i/B unless clipped (then 0)."""
    b = len(err)
    sums = {}
    for i in range(b):
        g = groups[i]
        size = sum(1 for j in range(b) if groups[j] == g)
        sums[g] = sums.get(g, 0.0) + adv[i] * beta * (err[i] - ref_err[i]) / size
    w = np.array([sigmoid(sums[groups[i]]) for i in range(b)])
    loss = float(np.mean(w * adv * err))
    grad = np.array([0.0 if clip[i] else w[i] * adv[i] / b for i in range(b)])
    return loss, grad, w


@pytest.mark.parametrize("use_clip", [False, True])
def test_dgpo_loss_and_gradient_match_reference(use_clip):
    rng = np.random.default_rng(0)
    groups = np.array([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])  # 3 groups of 4, interleaved
    err = rng.uniform(0.2, 1.5, 12)
    ref_err = err + rng.normal(0, 0.01, 12)
    adv = rng.normal(size=12)
    clip = rng.uniform(size=12) < 0.3 if use_clip else np.zeros(12, bool)
    beta = 100.0
    want_loss, want_grad, want_w = ref_dgpo(err, ref_err, adv, groups, beta, clip)
    e = t64(err).requires_grad_(True)
    per, w = dgpo_loss(e, t64(ref_err), t64(adv), torch.as_tensor(groups), beta,
                       torch.as_tensor(clip) if use_clip else None)
    per.mean().backward()
    np.testing.assert_allclose(per.mean().item(), want_loss, rtol=1e-12)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-12)
    np.testing.assert_allclose(e.grad.numpy(), want_grad, rtol=1e-12, atol=1e-15)


def test_dgpo_gradient_reaches_the_velocity():
    """e = mean_d (v − t)²: d loss/dv = w·A·2(v − t)/(D·B), the group weight held constant."""
    rng = np.random.default_rng(1)
    b, d = 4, 6
    v0, tgt = rng.normal(size=(b, d)), rng.normal(size=(b, d))
    groups, adv = np.array([0, 0, 1, 1]), np.array([1.0, -1.0, 0.5, -0.5])
    ref_err = ((v0 - tgt) ** 2).mean(1) + 0.01
    v = t64(v0).requires_grad_(True)
    err = dsm_error({"x": v}, {"x": t64(tgt)})
    per, w = dgpo_loss(err, t64(ref_err), t64(adv), torch.as_tensor(groups), 10.0)
    per.mean().backward()
    _, _, w_ref = ref_dgpo(((v0 - tgt) ** 2).mean(1), ref_err, adv, groups, 10.0, np.zeros(b, bool))
    np.testing.assert_allclose(v.grad.numpy(), (w_ref * adv)[:, None] * 2 * (v0 - tgt) / (d * b), rtol=1e-12)


def test_dgpo_clip_mask_hand_cases():
    """ρ = exp(e_old − e): A > 0 clipped when ρ > 1 + 1e-4, A ≤ 0 clipped when ρ < 1 − 1e-4."""
    err = t64([1.0, 1.0, 1.0, 1.0, 1.0])
    old = t64([1.001, 0.99995, 0.999, 1.00005, 1.0])
    adv = t64([1.0, 1.0, -1.0, -1.0, 0.0])
    got = dgpo_clip_mask(err, old, adv, -1e-4, 1e-4)
    assert got.tolist() == [True, False, True, False, False]


def test_ema_ref_decay_ramp():
    assert [ema_ref_decay(s, 0.001, 0.3) for s in (0, 10, 299, 300, 5000)] == pytest.approx([0, 0.01, 0.299, 0.3, 0.3])


def test_group_noise_is_shared_within_groups_only_and_keyed_by_the_group():
    x0 = {"x": torch.zeros(6, 2, 3)}
    draws = UpdateDraws(11)
    eps = group_noise(x0, torch.tensor([5, 7, 5, 9, 7, 5]), draws)["x"]
    assert torch.equal(eps[0], eps[2]) and torch.equal(eps[0], eps[5]) and torch.equal(eps[1], eps[4])
    assert not torch.equal(eps[0], eps[1]) and not torch.equal(eps[1], eps[3])
    # a group's noise depends on its id only, not on which other groups share the micro-batch (§7)
    alone = group_noise({"x": torch.zeros(2, 2, 3)}, torch.tensor([9, 9]), draws)["x"]
    assert torch.equal(alone[0], eps[3]) and torch.equal(alone[1], eps[3])


def test_noise_to_flow_matching_interpolation():
    rng = np.random.default_rng(2)
    x0, eps, s = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), np.array([0.2, 0.5, 0.9])
    x_t, target = noise_to({"x": t64(x0)}, {"x": t64(eps)}, t64(s))
    np.testing.assert_allclose(x_t["x"].numpy(), (1 - s[:, None]) * x0 + s[:, None] * eps, rtol=1e-12)
    np.testing.assert_allclose(target["x"].numpy(), eps - x0, rtol=1e-12)


# ------------------------------------------------------------------------------------------------ time sampling
def ref_discrete(sigmas, lo, hi, k, terms, u):
    """Flow-Factory `TimeSampler.discrete` on the 1000 scale, term k with draw u."""
    ts = 1000.0 * np.asarray(sigmas[:-1], np.float64)
    t_min, t_max = 1000.0 * (1 - hi), 1000.0 * (1 - lo)
    valid = np.nonzero((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    b = np.linspace(valid.min(), valid.max(), terms + 1)
    lower, upper = int(b[k]), int(b[k + 1])
    return ts[lower + int(u * (upper - lower))] / 1000.0


def test_discrete_sigma_matches_flow_factory_sampler():
    shift = 3.0
    raw = np.linspace(1, 0, 11)[:-1]
    grid = np.append(shift * raw / (1 + (shift - 1) * raw), 0.0)  # a shifted 10-step grid
    for lo, hi, terms in ((0.0, 0.6, 6), (0.0, 0.9, 9), (0.1, 0.5, 2)):
        for k in range(terms):
            for u in (0.0, 0.3, 0.71, 0.999):
                got = discrete_sigma(torch.tensor(grid, dtype=torch.float32), lo, hi, k, terms, u)
                assert got == pytest.approx(ref_discrete(grid.astype(np.float32), lo, hi, k, terms, u), rel=1e-6)


def test_discrete_sigma_outside_the_grid_is_one_line():
    with pytest.raises(ValueError, match=r"timestep_range=\[0.0, 0.01\] holds no step"):
        discrete_sigma(torch.tensor([0.9, 0.5, 0.0]), 0.0, 0.01, 0, 1, 0.5)


def test_uniform_sigma_strata():
    assert uniform_sigma(0.0, 0.6, 0, 3, 0.5) == pytest.approx(0.9)
    assert uniform_sigma(0.0, 0.6, 2, 3, 0.0) == pytest.approx(0.6)


# ------------------------------------------------------------------------------------------------ AWM
def ref_weighting(m, s, scheme, p):
    if scheme == "Uniform":
        return m
    if scheme == "t":
        return m * s
    if scheme == "t**2":
        return m * s * s
    if scheme == "huber":
        return -(math.sqrt(-m + 1e-10) - 1e-5) * s
    return -((-m + 1e-10) ** p - 1e-10**p) * s / p


@pytest.mark.parametrize("scheme", ["Uniform", "t", "t**2", "huber", "ghuber"])
def test_matching_log_prob_two_entries_each_at_its_sigma(scheme):
    """Entries of 8 and 4 elements at their own σ: Σ_e D_e·W(m_e, σ_e) / Σ_e D_e with m_e = −mean_d (v − t)²."""
    rng = np.random.default_rng(3)
    va, ta, vb, tb = rng.normal(size=(3, 8)), rng.normal(size=(3, 8)), rng.normal(size=(3, 2, 2)), rng.normal(size=(3, 2, 2))
    sa, sb = np.array([0.3, 0.6, 0.9]), np.array([0.1, 0.4, 0.8])
    got = matching_log_prob({"a": t64(va), "b": t64(vb)}, {"a": t64(ta), "b": t64(tb)}, {"a": t64(sa), "b": t64(sb)},
                            scheme, 0.25)
    want = []
    for i in range(3):
        ma, mb = -((va[i] - ta[i]) ** 2).mean(), -((vb[i] - tb[i]) ** 2).mean()
        want.append((8 * ref_weighting(ma, sa[i], scheme, 0.25) + 4 * ref_weighting(mb, sb[i], scheme, 0.25)) / 12)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)  # float32 out, as Flow-Factory's .float()


def test_matching_weighting_unknown_scheme():
    with pytest.raises(ValueError, match="algorithm.weighting='cubic'; allowed: Uniform"):
        matching_weighting(t64([-1.0]), t64([0.5]), "cubic", 0.25)


def test_awm_loss_values_and_gradient():
    """ℓ = max(−A·ρ, −A·clip(ρ, 1 − 1e-4, 1 + 1e-4)); on policy (old = sg(log p)) ρ = 1 and d mean ℓ/d log p = −A/B;
    a sample whose ratio left the range on the advantage's side gets no gradient."""
    rng = np.random.default_rng(4)
    lp0, adv = rng.normal(size=6), rng.normal(size=6)
    lp = t64(lp0).requires_grad_(True)
    per, ratio, clipped = awm_loss(lp, lp.detach(), t64(adv), -1e-4, 1e-4)
    per.mean().backward()
    np.testing.assert_allclose(ratio.detach().numpy(), 1.0)
    assert not clipped.any()
    np.testing.assert_allclose(lp.grad.numpy(), -adv / 6, rtol=1e-12)
    # off policy: a float64 loop of the PPO surrogate and its gradient
    old = lp0 + np.array([1e-3, -1e-3, 5e-5, -5e-5, 2e-3, -2e-3])
    adv = np.array([-1.0, 1.0, 2.0, -2.0, 1.0, -1.0])
    lp = t64(lp0).requires_grad_(True)
    per, ratio, clipped = awm_loss(lp, t64(old), t64(adv), -1e-4, 1e-4)
    per.sum().backward()
    for i in range(6):
        r = math.exp(lp0[i] - old[i])
        rc = min(max(r, 1 - 1e-4), 1 + 1e-4)
        assert per[i].item() == pytest.approx(max(-adv[i] * r, -adv[i] * rc), rel=1e-12)
        grad = -adv[i] * r if -adv[i] * r >= -adv[i] * rc else 0.0
        assert lp.grad[i].item() == pytest.approx(grad, rel=1e-12, abs=1e-15)


# ------------------------------------------------------------------------------------------------ whole groups
def test_group_minibatches_hold_whole_groups_once():
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    mbs = group_minibatches(ids, 2, torch.Generator().manual_seed(0))
    assert len(mbs) == 2 and sorted(torch.cat(mbs).tolist()) == list(range(10))
    for mb in mbs:
        groups = set(ids[mb].tolist())
        assert sorted(mb.tolist()) == sorted(torch.nonzero(torch.isin(ids, torch.tensor(list(groups)))).flatten().tolist())
    parts = group_micro_batches(mbs[0], ids, 3)  # 3 samples: one group of 2 per micro-batch
    assert all(len(p) == 2 and len(set(ids[p].tolist())) == 1 for p in parts)
    parts = group_micro_batches(mbs[0], ids, 4)
    assert all(len(p) in (2, 4) for p in parts) and sum(len(p) for p in parts) == len(mbs[0])
    assert group_micro_batches(mbs[0], ids, 1)[0].tolist() == mbs[0][:2].tolist()  # a group is never split


def ref_discrete_wo_init(sigmas, lo, hi, k, terms, u):
    """Flow-Factory `TimeSampler.discrete(include_init=False)` (its `discrete_wo_init`, 3fe9f76): the stratified
    span starts one index after the first grid step inside the range."""
    ts = 1000.0 * np.asarray(sigmas[:-1], np.float64)
    t_min, t_max = 1000.0 * (1 - hi), 1000.0 * (1 - lo)
    valid = np.nonzero((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    b = np.linspace(valid.min() + 1, valid.max(), terms + 1)
    lower, upper = int(b[k]), int(b[k + 1])
    return ts[lower + int(u * (upper - lower))] / 1000.0


def test_discrete_without_init_matches_flow_factory_sampler():
    shift = 3.0
    raw = np.linspace(1, 0, 15)[:-1]
    grid = np.append(shift * raw / (1 + (shift - 1) * raw), 0.0)  # a shifted 14-step grid (Flow-Factory's AWM recipe)
    for lo, hi, terms in ((0.0, 0.9, 6), (0.0, 0.6, 4), (0.2, 0.9, 3)):
        for k in range(terms):
            for u in (0.0, 0.3, 0.71, 0.999):
                got = discrete_sigma(torch.tensor(grid, dtype=torch.float32), lo, hi, k, terms, u, include_init=False)
                want = ref_discrete_wo_init(grid.astype(np.float32), lo, hi, k, terms, u)
                assert got == pytest.approx(want, rel=1e-6) and got < 1.0
