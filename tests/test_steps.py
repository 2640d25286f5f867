"""Tests of the Flow-GRPO SDE step (polyrl/sampling/steps.py) against docs/algorithms.md §1.

Every expected value comes from a float64 per-sample numpy/scipy reference written from the formulas, never from
the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from polyrl.sampling.steps import STEPS, sde_step

SIGMA_1 = 0.9  # the first sigma below 1 of the grid used in these tests


# ------------------------------------------------------------------------------------------------ reference
def ref_coeffs(sigma: float, sigma_next: float, a: float, sigma_1: float) -> tuple[float, float, float, float]:
    """(std, dt, x coefficient, v coefficient) of one sample, in plain Python floats."""
    dt = sigma_next - sigma
    sigma_tilde = sigma_1 if sigma == 1.0 else sigma
    std = a * math.sqrt(sigma / (1.0 - sigma_tilde))
    cx = 1.0 + std * std * dt / (2.0 * sigma)
    cv = (1.0 + std * std * (1.0 - sigma) / (2.0 * sigma)) * dt
    return std, dt, cx, cv


def ref_step(x, v, sigma, sigma_next, a, sigma_1, z=None, prev=None):
    """Per-sample loop: returns (sample, log_prob, mean, scale) as float64 numpy arrays."""
    x, v = np.asarray(x, np.float64), np.asarray(v, np.float64)
    b = x.shape[0]
    sigma, sigma_next, a = (np.broadcast_to(np.asarray(t, np.float64), (b,)) for t in (sigma, sigma_next, a))
    means, samples, lps, scales = [], [], [], []
    for i in range(b):
        std, dt, cx, cv = ref_coeffs(float(sigma[i]), float(sigma_next[i]), float(a[i]), sigma_1)
        mu = cx * x[i] + cv * v[i]
        scale = std * math.sqrt(-dt)
        xp = np.asarray(prev[i], np.float64) if prev is not None else mu + scale * np.asarray(z[i], np.float64)
        lp = float(norm.logpdf(xp, loc=mu, scale=scale).mean()) if scale > 0 else 0.0
        means.append(mu)
        samples.append(xp)
        lps.append(lp)
        scales.append(scale)
    return np.stack(samples), np.array(lps), np.stack(means), np.array(scales)


def rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# sigma, sigma_next pairs: the first step (σ = 1, uses σ_1), middle steps, and the last step to σ' = 0
PAIRS = [(1.0, 0.9), (0.9, 0.75), (0.5, 0.3), (0.2, 0.0)]


# ------------------------------------------------------------------------------------------------ mean / log-prob
@pytest.mark.parametrize("sigma,sigma_next", PAIRS)
@pytest.mark.parametrize("a", [0.3, 0.7, 1.2])
def test_sde_step_matches_reference_scalar_sigmas(sigma, sigma_next, a):
    x, v, z = rand(3, 2, 4, 5, seed=1), rand(3, 2, 4, 5, seed=2), rand(3, 2, 4, 5, seed=3)
    out = sde_step(x, v, sigma, sigma_next, a, SIGMA_1, noise=z)
    sample, lp, mean, scale = ref_step(x.numpy(), v.numpy(), sigma, sigma_next, a, SIGMA_1, z=z.numpy())
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.sample.numpy(), sample, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.std.numpy(), scale, rtol=1e-12)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-10, atol=1e-12)
    assert out.log_prob.shape == (3,) and out.std.shape == (3,)
    assert out.mean.dtype == torch.float64 and out.log_prob.dtype == torch.float64


def test_sigma_one_uses_sigma_1_closed_form():
    # σ = 1, σ_1 = 0.75, a = 0.5: std = 0.5·sqrt(1/0.25) = 1; dt = -0.25 -> scale = 0.5
    # μ = x(1 + 1·(-0.25)/2) + v(1 + 0)(-0.25) = 0.875x - 0.25v
    x = torch.tensor([[2.0, -4.0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 8.0]], dtype=torch.float64)
    z = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    out = sde_step(x, v, 1.0, 0.75, 0.5, 0.75, noise=z)
    np.testing.assert_allclose(out.std.numpy(), [0.5], rtol=1e-12)
    np.testing.assert_allclose(out.mean.numpy(), [[1.5, -5.5]], rtol=1e-12)
    np.testing.assert_allclose(out.sample.numpy(), [[2.0, -6.5]], rtol=1e-12)
    # log N(x'; μ, 0.5²) with x'−μ = 0.5·z: mean_d(−z²/2) − log 0.5 − ½ log 2π
    expected = -(1.0 + 4.0) / 4 - math.log(0.5) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(expected, rel=1e-12)


def test_sigma_1_only_matters_at_sigma_one():
    x, v, z = rand(2, 6, seed=4), rand(2, 6, seed=5), rand(2, 6, seed=6)
    a = sde_step(x, v, 0.6, 0.4, 0.7, 0.9, noise=z)
    b = sde_step(x, v, 0.6, 0.4, 0.7, 0.5, noise=z)
    assert torch.equal(a.sample, b.sample)
    c = sde_step(x, v, 1.0, 0.8, 0.7, 0.9, noise=z)
    d = sde_step(x, v, 1.0, 0.8, 0.7, 0.5, noise=z)
    assert not torch.allclose(c.std, d.std)


def test_sde_step_per_sample_sigmas_and_noise_levels():
    b = 6
    sigma = torch.tensor([1.0, 0.9, 0.5, 0.2, 1.0, 0.7], dtype=torch.float64)
    sigma_next = torch.tensor([0.9, 0.75, 0.3, 0.0, 0.9, 0.6], dtype=torch.float64)
    a = torch.tensor([0.7, 0.0, 1.0, 0.3, 0.2, 0.9], dtype=torch.float64)  # sample 1 is an ODE step
    x, v, z = rand(b, 3, 4, seed=7), rand(b, 3, 4, seed=8), rand(b, 3, 4, seed=9)
    out = sde_step(x, v, sigma, sigma_next, a, SIGMA_1, noise=z)
    sample, lp, mean, scale = ref_step(x.numpy(), v.numpy(), sigma.numpy(), sigma_next.numpy(), a.numpy(), SIGMA_1,
                                       z=z.numpy())
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.sample.numpy(), sample, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.std.numpy(), scale, rtol=1e-12, atol=0)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-10, atol=1e-12)
    assert out.log_prob[1].item() == 0.0 and out.std[1].item() == 0.0
    # each row equals the same row stepped on its own with scalar sigmas
    for i in range(b):
        row = sde_step(x[i:i + 1], v[i:i + 1], sigma[i].item(), sigma_next[i].item(), a[i].item(), SIGMA_1,
                       noise=z[i:i + 1])
        np.testing.assert_allclose(row.sample.numpy(), out.sample[i:i + 1].numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(row.log_prob.numpy(), out.log_prob[i:i + 1].numpy(), rtol=1e-12, atol=1e-14)


def test_prev_scores_given_sample():
    sigma = torch.tensor([1.0, 0.8, 0.4], dtype=torch.float64)
    sigma_next = torch.tensor([0.9, 0.6, 0.1], dtype=torch.float64)
    a = torch.tensor([0.7, 0.5, 1.0], dtype=torch.float64)
    x, v = rand(3, 2, 8, seed=10), rand(3, 2, 8, seed=11)
    prev = rand(3, 2, 8, seed=12)  # an arbitrary sample, not drawn from this step
    out = sde_step(x, v, sigma, sigma_next, a, SIGMA_1, prev=prev)
    _, lp, mean, scale = ref_step(x.numpy(), v.numpy(), sigma.numpy(), sigma_next.numpy(), a.numpy(), SIGMA_1,
                                  prev=prev.numpy())
    assert torch.equal(out.sample, prev)
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.std.numpy(), scale, rtol=1e-12)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-10, atol=1e-12)


def test_prev_rescoring_of_own_draw_gives_same_log_prob():
    x, v, z = rand(4, 10, seed=13), rand(4, 10, seed=14), rand(4, 10, seed=15)
    drawn = sde_step(x, v, 0.7, 0.55, 0.8, SIGMA_1, noise=z)
    scored = sde_step(x, v, 0.7, 0.55, 0.8, SIGMA_1, prev=drawn.sample)
    np.testing.assert_allclose(scored.log_prob.numpy(), drawn.log_prob.numpy(), rtol=1e-12, atol=1e-12)
    # x' − μ = scale·z exactly, so log p = mean_d(−z²/2) − log(scale) − ½ log 2π
    scale = 0.8 * math.sqrt(0.7 / 0.3) * math.sqrt(0.15)
    expected = (-(z.numpy() ** 2) / 2).mean(1) - math.log(scale) - 0.5 * math.log(2 * math.pi)
    np.testing.assert_allclose(drawn.log_prob.numpy(), expected, rtol=1e-10)


def test_drawn_sample_is_mean_plus_scale_times_noise():
    x, v, z = rand(2, 3, 3, seed=16), rand(2, 3, 3, seed=17), rand(2, 3, 3, seed=18)
    sigma, sigma_next, a = torch.tensor([0.9, 0.3], dtype=torch.float64), torch.tensor([0.8, 0.1]), 0.6
    out = sde_step(x, v, sigma, sigma_next.double(), a, SIGMA_1, noise=z)
    _, _, mean, scale = ref_step(x.numpy(), v.numpy(), sigma.numpy(), sigma_next.numpy(), a, SIGMA_1, z=z.numpy())
    np.testing.assert_allclose(out.sample.numpy(), mean + scale[:, None, None] * z.numpy(), rtol=1e-12, atol=1e-12)


def test_float32_inputs_stay_float32_and_match():
    x, v, z = (rand(2, 16, seed=s, dtype=torch.float32) for s in (19, 20, 21))
    out = sde_step(x, v, 0.8, 0.65, 0.7, SIGMA_1, noise=z)
    sample, lp, mean, _ = ref_step(x.numpy(), v.numpy(), 0.8, 0.65, 0.7, SIGMA_1, z=z.numpy())
    assert out.sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    np.testing.assert_allclose(out.sample.numpy(), sample, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-5, atol=1e-5)


def test_registry_has_sde():
    assert STEPS["sde"] is sde_step


# ------------------------------------------------------------------------------------------------ a = 0
@pytest.mark.parametrize("sigma,sigma_next", PAIRS)
def test_zero_noise_is_euler_step(sigma, sigma_next):
    x, v, z = rand(3, 4, 4, seed=22), rand(3, 4, 4, seed=23), rand(3, 4, 4, seed=24)
    out = sde_step(x, v, sigma, sigma_next, 0.0, SIGMA_1, noise=z)
    dt = sigma_next - sigma
    assert torch.equal(out.sample, x + v * dt)
    assert torch.equal(out.mean, x + v * dt)
    assert torch.equal(out.log_prob, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(out.std, torch.zeros(3, dtype=torch.float64))
    # the random draw does not matter either
    out2 = sde_step(x, v, sigma, sigma_next, 0.0, SIGMA_1)
    assert torch.equal(out2.sample, x + v * dt)


# ------------------------------------------------------------------------------------------------ statistics
def test_empirical_moments_of_draws():
    torch.manual_seed(0)
    k, d = 20000, 4
    x0 = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    v0 = torch.tensor([1.0, 0.3, -0.7, 2.0], dtype=torch.float64)
    x, v = x0.expand(k, d).contiguous(), v0.expand(k, d).contiguous()
    out = sde_step(x, v, 0.8, 0.6, 0.9, SIGMA_1)
    _, _, mean, scale = ref_step(x0[None].numpy(), v0[None].numpy(), 0.8, 0.6, 0.9, SIGMA_1, z=np.zeros((1, d)))
    s = out.sample.numpy()
    # 5 standard errors of the sample mean and sample std
    np.testing.assert_allclose(s.mean(0), mean[0], atol=5 * scale[0] / math.sqrt(k))
    np.testing.assert_allclose(s.std(0), np.full(d, scale[0]), rtol=5 / math.sqrt(2 * k))
    # draws are independent across elements and samples
    c = np.corrcoef(s.T)
    assert np.abs(c - np.eye(d)).max() < 5 / math.sqrt(k)
    # E[log p] = −½ − log s − ½ log 2π
    expected_lp = -0.5 - math.log(scale[0]) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.mean().item() == pytest.approx(expected_lp, abs=5 * math.sqrt(0.5 / d) / math.sqrt(k))


# ------------------------------------------------------------------------------------------------ gradients
def test_log_prob_gradient_wrt_v_analytic_and_finite_difference():
    sigma = torch.tensor([1.0, 0.7, 0.3], dtype=torch.float64)
    sigma_next = torch.tensor([0.9, 0.5, 0.0], dtype=torch.float64)
    a = torch.tensor([0.7, 1.0, 0.0], dtype=torch.float64)  # the last sample is deterministic: zero gradient
    x, prev = rand(3, 2, 3, seed=25), rand(3, 2, 3, seed=26)
    v = rand(3, 2, 3, seed=27).requires_grad_(True)
    out = sde_step(x, v, sigma, sigma_next, a, SIGMA_1, prev=prev)
    out.log_prob.sum().backward()
    grad = v.grad.numpy()

    xn, vn, pn = x.numpy(), v.detach().numpy(), prev.numpy()
    d = xn[0].size
    analytic = np.zeros_like(grad)
    for i in range(3):
        std, dt, cx, cv = ref_coeffs(float(sigma[i]), float(sigma_next[i]), float(a[i]), SIGMA_1)
        s2 = std * std * (-dt)
        if s2 > 0:
            mu = cx * xn[i] + cv * vn[i]
            analytic[i] = (pn[i] - mu) / s2 * cv / d  # d/dv of mean_d −(x'−μ)²/(2s²), dμ/dv = cv
    np.testing.assert_allclose(grad, analytic, rtol=1e-10, atol=1e-12)
    assert np.all(grad[2] == 0)

    # central differences of the scipy reference
    h = 1e-6
    fd = np.zeros_like(grad)
    for idx in np.ndindex(*vn.shape):
        vp, vm = vn.copy(), vn.copy()
        vp[idx] += h
        vm[idx] -= h
        lp_p = ref_step(xn, vp, sigma.numpy(), sigma_next.numpy(), a.numpy(), SIGMA_1, prev=pn)[1]
        lp_m = ref_step(xn, vm, sigma.numpy(), sigma_next.numpy(), a.numpy(), SIGMA_1, prev=pn)[1]
        fd[idx] = (lp_p.sum() - lp_m.sum()) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)


def test_gradient_flows_to_v_in_float32():
    x, prev = rand(2, 5, seed=28, dtype=torch.float32), rand(2, 5, seed=29, dtype=torch.float32)
    v = rand(2, 5, seed=30, dtype=torch.float32).requires_grad_(True)
    out = sde_step(x, v, 0.6, 0.5, 0.7, SIGMA_1, prev=prev)
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
