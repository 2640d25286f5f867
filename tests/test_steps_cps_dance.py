"""Tests of the `cps` and `dance` reverse steps (polyrl/sampling/steps.py, docs/algorithms.md §1).

References are per-sample float64 numpy/scipy loops written from the formulas (x̂0/ε̂ form for cps, the
drift-plus-score form for dance), never from the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from polyrl.sampling.steps import STEPS, cps_step, dance_step, sde_step

SIGMA_1 = 0.9


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ref_cps(x, v, sigma, sigma_next, a, z=None, prev=None):
    """(sample, log_prob, mean, std) of one cps step per sample, float64."""
    out = []
    for i in range(x.shape[0]):
        s, sn, ai = float(sigma[i]), float(sigma_next[i]), float(a[i])
        x0 = x[i] - s * v[i]
        eps = x[i] + (1.0 - s) * v[i]
        std = sn * math.sin(ai * math.pi / 2.0)
        mu = (1.0 - sn) * x0 + math.sqrt(max(sn * sn - std * std, 0.0)) * eps
        xp = prev[i] if prev is not None else mu + std * z[i]
        lp = float(norm.logpdf(xp, mu, std).mean()) if std > 0 else 0.0
        out.append((xp, lp, mu, std))
    return tuple(np.array([o[j] for o in out]) for j in range(4))


def ref_dance(x, v, sigma, sigma_next, eta, z=None, prev=None):
    """Dance step as drift f = v − ½η²·score with score = −ε̂/σ (ε̂ = x + (1−σ)v): μ = x + f·dt."""
    out = []
    for i in range(x.shape[0]):
        s, sn, e = float(sigma[i]), float(sigma_next[i]), float(eta[i])
        dt = sn - s
        score = -(x[i] + (1.0 - s) * v[i]) / s
        mu = x[i] + (v[i] - 0.5 * e * e * score) * dt
        std = e * math.sqrt(-dt)
        xp = prev[i] if prev is not None else mu + std * z[i]
        lp = float(norm.logpdf(xp, mu, std).mean()) if std > 0 else 0.0
        out.append((xp, lp, mu, std))
    return tuple(np.array([o[j] for o in out]) for j in range(4))


SIGMA = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.2], dtype=torch.float64)
SIGMA_NEXT = torch.tensor([0.9, 0.75, 0.4, 0.1, 0.0], dtype=torch.float64)
LEVEL = torch.tensor([0.7, 0.3, 1.0, 0.5, 0.8], dtype=torch.float64)


def test_registry_names():
    assert set(STEPS) == {"sde", "cps", "dance"}


@pytest.mark.parametrize("step,ref", [(cps_step, ref_cps), (dance_step, ref_dance)])
def test_step_matches_reference_random_inputs(step, ref):
    x, v, z = rand(5, 2, 3, 3, seed=1), rand(5, 2, 3, 3, seed=2), rand(5, 2, 3, 3, seed=3)
    out = step(x, v, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_1, noise=z)
    sample, lp, mean, std = ref(x.numpy(), v.numpy(), SIGMA.numpy(), SIGMA_NEXT.numpy(), LEVEL.numpy(), z=z.numpy())
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.sample.numpy(), sample, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.std.numpy(), std, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-10, atol=1e-12)
    # re-scoring the drawn sample gives the same log-prob
    again = step(x, v, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_1, prev=out.sample)
    np.testing.assert_allclose(again.log_prob.numpy(), out.log_prob.numpy(), rtol=1e-12, atol=1e-12)


def test_cps_hand_values():
    # σ = 0.5, σ' = 0.25, a = 1/3: s = 0.25·sin(π/6) = 0.125; sqrt(σ'² − s²) = sqrt(0.046875)
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    v = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    out = cps_step(x, v, 0.5, 0.25, 1 / 3, SIGMA_1, noise=torch.tensor([[1.0, -1.0]], dtype=torch.float64))
    # x̂0 = [0, −2], ε̂ = [2, −2]
    c = math.sqrt(0.0625 - 0.015625)
    expected_mean = [0.75 * 0 + c * 2, 0.75 * -2 + c * -2]
    np.testing.assert_allclose(out.mean.numpy()[0], expected_mean, rtol=1e-12)
    assert out.std.item() == pytest.approx(0.125, rel=1e-12)
    np.testing.assert_allclose(out.sample.numpy()[0], np.array(expected_mean) + [0.125, -0.125], rtol=1e-12)
    assert out.log_prob.item() == pytest.approx(-0.5 - math.log(0.125) - 0.5 * math.log(2 * math.pi), rel=1e-12)


@pytest.mark.parametrize("step", [cps_step, dance_step])
def test_zero_level_is_euler(step):
    x, v = rand(5, 4, seed=4), rand(5, 4, seed=5)
    out = step(x, v, SIGMA, SIGMA_NEXT, 0.0, SIGMA_1, noise=rand(5, 4, seed=6))
    euler = x + v * (SIGMA_NEXT - SIGMA)[:, None]
    np.testing.assert_allclose(out.sample.numpy(), euler.numpy(), rtol=1e-12, atol=1e-14)
    assert torch.equal(out.log_prob, torch.zeros(5, dtype=torch.float64))
    assert torch.equal(out.std, torch.zeros(5, dtype=torch.float64))


def test_cps_last_step_lands_on_predicted_clean_latent():
    x, v = rand(2, 6, seed=7), rand(2, 6, seed=8)
    out = cps_step(x, v, 0.2, 0.0, 0.9, SIGMA_1, noise=rand(2, 6, seed=9))
    np.testing.assert_allclose(out.sample.numpy(), (x - 0.2 * v).numpy(), rtol=1e-12, atol=1e-14)
    assert out.std.abs().max().item() == 0.0 and out.log_prob.abs().max().item() == 0.0


def test_cps_preserves_the_marginal_coefficients():
    """With the true x0 and ε (v = ε − x0), E[x'] and Var keep x_{σ'} = (1−σ')x0 + σ'ε: the noise coefficient
    of ε is sqrt(σ'² − s²), and the fresh noise adds s², so the total noise variance is σ'²."""
    x0, eps = rand(1, 8, seed=10), rand(1, 8, seed=11)
    sigma, sigma_next, a = 0.7, 0.5, 0.6
    x = (1 - sigma) * x0 + sigma * eps
    out = cps_step(x, eps - x0, sigma, sigma_next, a, SIGMA_1, noise=torch.zeros(1, 8, dtype=torch.float64))
    s = sigma_next * math.sin(a * math.pi / 2)
    expected = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - s**2) * eps
    np.testing.assert_allclose(out.mean.numpy(), expected.numpy(), rtol=1e-12, atol=1e-14)
    assert math.sqrt(sigma_next**2 - s**2) ** 2 + s**2 == pytest.approx(sigma_next**2, rel=1e-12)


def test_dance_equals_sde_with_constant_diffusion_coefficient():
    """`sde` with a_i = η·sqrt((1−σ̃_i)/σ_i) has diffusion a·sqrt(σ/(1−σ̃)) = η: the same transition as `dance`."""
    eta = 0.45
    x, v, z = rand(5, 3, 4, seed=12), rand(5, 3, 4, seed=13), rand(5, 3, 4, seed=14)
    sigma_tilde = torch.where(SIGMA >= 1, torch.full_like(SIGMA, SIGMA_1), SIGMA)
    a = eta * torch.sqrt((1 - sigma_tilde) / SIGMA)
    d = dance_step(x, v, SIGMA, SIGMA_NEXT, eta, SIGMA_1, noise=z)
    s = sde_step(x, v, SIGMA, SIGMA_NEXT, a, SIGMA_1, noise=z)
    for got, want in ((d.mean, s.mean), (d.sample, s.sample), (d.std, s.std), (d.log_prob, s.log_prob)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("step,ref", [(cps_step, ref_cps), (dance_step, ref_dance)])
def test_log_prob_gradient_matches_finite_differences_of_reference(step, ref):
    x, prev = rand(5, 2, 3, seed=15), rand(5, 2, 3, seed=16)
    prev = prev * 0.1 + x  # near the mean, so the log-density is well scaled
    v = rand(5, 2, 3, seed=17).requires_grad_(True)
    out = step(x, v, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_1, prev=prev)
    out.log_prob.sum().backward()
    xn, vn, pn = x.numpy(), v.detach().numpy(), prev.numpy()
    args = (SIGMA.numpy(), SIGMA_NEXT.numpy(), LEVEL.numpy())
    h, fd = 1e-6, np.zeros_like(vn)
    for idx in np.ndindex(*vn.shape):
        vp, vm = vn.copy(), vn.copy()
        vp[idx] += h
        vm[idx] -= h
        fd[idx] = (ref(xn, vp, *args, prev=pn)[1].sum() - ref(xn, vm, *args, prev=pn)[1].sum()) / (2 * h)
    np.testing.assert_allclose(v.grad.numpy(), fd, rtol=1e-5, atol=1e-6)
    if step is cps_step:  # σ' = 0 for the last sample: deterministic, no gradient
        assert np.all(v.grad.numpy()[4] == 0)
