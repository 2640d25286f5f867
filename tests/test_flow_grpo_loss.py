"""Tests of the Flow-GRPO loss pieces (polyrl/algorithms/flow_grpo.py, docs/algorithms.md §3) on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.algorithms.flow_grpo import gaussian_mean_kl, ppo_clip_loss

# (advantage, ratio, per-sample loss, d loss_i / d log_prob_i, clipped) with ε = 0.2; loss = max(−Aρ, −A·clip(ρ))
EPS = 0.2
CASES = [
    (1.0, 1.1, -1.1, -1.1, False),   # A > 0, inside the range
    (1.0, 1.5, -1.2, 0.0, True),     # A > 0, above 1+ε: clipped at −1.2, no gradient
    (1.0, 0.5, -0.5, -0.5, False),   # A > 0, below 1−ε: the unclipped (pessimistic) term wins
    (-1.0, 1.5, 1.5, 1.5, False),    # A < 0, above 1+ε: unclipped wins
    (-1.0, 0.5, 0.8, 0.0, True),     # A < 0, below 1−ε: clipped at 0.8, no gradient
    (-2.0, 0.9, 1.8, 1.8, False),    # A < 0, inside
    (0.0, 1.7, 0.0, 0.0, False),     # A = 0
]


def test_ppo_clip_hand_cases_values_and_gradients():
    adv = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    ratio = [c[1] for c in CASES]
    old = torch.tensor([0.3, -1.0, 2.0, 0.0, -0.5, 1.0, 0.25], dtype=torch.float64)
    log_prob = (old + torch.tensor([math.log(r) for r in ratio], dtype=torch.float64)).requires_grad_(True)
    loss, rho, clipped = ppo_clip_loss(log_prob, old, adv, EPS)
    b = len(CASES)
    assert loss.item() == pytest.approx(sum(c[2] for c in CASES) / b, rel=1e-12)
    np.testing.assert_allclose(rho.detach().numpy(), ratio, rtol=1e-12)
    assert clipped.tolist() == [c[4] for c in CASES]
    loss.backward()
    # unclipped side: d(−A·ρ)/d log p = −A·ρ, divided by B for the mean
    np.testing.assert_allclose(log_prob.grad.numpy(), [c[3] / b for c in CASES], rtol=1e-12, atol=1e-15)


def test_ppo_clip_gradient_formula_unclipped():
    rng = np.random.default_rng(0)
    adv = torch.from_numpy(rng.normal(size=16))
    old = torch.from_numpy(rng.normal(size=16))
    lp = (old + torch.from_numpy(rng.uniform(-0.05, 0.05, size=16))).requires_grad_(True)
    loss, _, clipped = ppo_clip_loss(lp, old, adv, 0.1)  # every ratio within [0.95, 1.05]: nothing clipped
    assert not clipped.any()
    loss.backward()
    rho = np.exp(lp.detach().numpy() - old.numpy())
    np.testing.assert_allclose(lp.grad.numpy(), -adv.numpy() * rho / 16, rtol=1e-12)
    assert loss.item() == pytest.approx(float(np.mean(-adv.numpy() * rho)), rel=1e-12)


def test_ppo_clip_on_policy_first_update():
    # ρ = 1 at the first update: loss = −mean(A), gradient −A/B, with the tiny Flow-GRPO ε
    adv = torch.tensor([0.5, -1.5, 2.0, -1.0], dtype=torch.float64)
    lp = torch.tensor([-3.0, -2.0, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    loss, rho, clipped = ppo_clip_loss(lp, lp.detach().clone(), adv, 1e-4)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-15)
    assert torch.equal(rho.detach(), torch.ones(4, dtype=torch.float64)) and not clipped.any()
    np.testing.assert_allclose(lp.grad.numpy(), -adv.numpy() / 4, rtol=1e-12)


def test_ppo_clip_tiny_eps_clips_just_outside():
    eps = 1e-4
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    delta = torch.tensor([3e-4, 5e-5, -3e-4, -5e-5], dtype=torch.float64)  # log-ratio
    lp = delta.clone().requires_grad_(True)
    loss, _, clipped = ppo_clip_loss(lp, torch.zeros(4, dtype=torch.float64), adv, eps)
    assert clipped.tolist() == [True, False, True, False]
    loss.backward()
    r = np.exp(delta.numpy())
    expected = [-(1 + eps), -r[1], (1 - eps), r[3]]
    assert loss.item() == pytest.approx(np.mean(expected), rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), [0.0, -r[1] / 4, 0.0, r[3] / 4], rtol=1e-12, atol=1e-15)


def ref_kl(mean, ref_mean, std):
    """Per-sample mean over elements of the exact KL(N(μ, s²) || N(μ_ref, s²)) from the general two-Gaussian form."""
    mean, ref_mean = np.asarray(mean, np.float64), np.asarray(ref_mean, np.float64)
    out = []
    for i in range(mean.shape[0]):
        s1 = s2 = float(std[i])
        kl = np.log(s2 / s1) + (s1**2 + (mean[i] - ref_mean[i]) ** 2) / (2 * s2**2) - 0.5
        out.append(kl.mean())
    return np.array(out)


def test_gaussian_mean_kl_matches_reference():
    rng = np.random.default_rng(1)
    mean, ref_mean = rng.normal(size=(3, 2, 4, 4)), rng.normal(size=(3, 2, 4, 4))
    std = np.array([0.05, 0.3, 1.7])
    out = gaussian_mean_kl(torch.from_numpy(mean), torch.from_numpy(ref_mean), torch.from_numpy(std))
    assert out.shape == (3,)
    np.testing.assert_allclose(out.numpy(), ref_kl(mean, ref_mean, std), rtol=1e-10)


def test_gaussian_mean_kl_hand_value_and_zero():
    mean = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    # mean_d (Δ²) / (2·0.5²) = ((1 + 4)/2) / 0.5 = 5
    assert gaussian_mean_kl(mean, ref, torch.tensor([0.5], dtype=torch.float64)).item() == pytest.approx(5.0)
    assert gaussian_mean_kl(mean, mean, torch.tensor([0.5], dtype=torch.float64)).item() == 0.0


def test_gaussian_mean_kl_gradient():
    rng = np.random.default_rng(2)
    mean = torch.from_numpy(rng.normal(size=(2, 6))).requires_grad_(True)
    ref = torch.from_numpy(rng.normal(size=(2, 6)))
    std = torch.tensor([0.2, 0.9], dtype=torch.float64)
    gaussian_mean_kl(mean, ref, std).sum().backward()
    expected = (mean.detach().numpy() - ref.numpy()) / (std.numpy()[:, None] ** 2) / 6
    np.testing.assert_allclose(mean.grad.numpy(), expected, rtol=1e-12)
