"""Latent entries on their own σ schedules (MiniMax-H3: video shift 12, audio shift 3): the joint step, its
log-density and the KL terms against float64 references written out by hand (numpy)."""

import math

import numpy as np
import torch

from polyrl.algorithms.flow_grpo import gaussian_mean_kl, kl_to_reference
from polyrl.sampling.steps import sde_step, step_latents


def np_sde(x, v, sig, sig_next, a, sigma_1, z):
    """Flow-GRPO's sde step (docs/algorithms.md §1) for one sample, float64 numpy."""
    std = a * math.sqrt(sig / (1 - (sigma_1 if sig >= 1 else sig)))
    dt = sig_next - sig
    mean = x * (1 + std**2 * dt / (2 * sig)) + v * (1 + std**2 * (1 - sig) / (2 * sig)) * dt
    s = std * math.sqrt(-dt)
    prev = mean + s * z
    lp = (-((prev - mean) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).mean()
    return prev, mean, s, lp


def test_joint_step_uses_each_entrys_sigma():
    rng = np.random.default_rng(0)
    shapes = {"video": (3, 4), "audio": (5,)}
    x = {k: rng.standard_normal((2, *s)) for k, s in shapes.items()}
    v = {k: rng.standard_normal((2, *s)) for k, s in shapes.items()}
    z = {k: rng.standard_normal((2, *s)) for k, s in shapes.items()}
    sig = {"video": np.array([0.9, 0.6]), "audio": np.array([0.7, 0.3])}
    nxt = {"video": np.array([0.8, 0.5]), "audio": np.array([0.55, 0.2])}
    s1 = {"video": 0.95, "audio": 0.8}
    a = np.array([0.7, 0.7])
    t = lambda d: {k: torch.from_numpy(w) for k, w in d.items()}  # noqa: E731
    out = step_latents(sde_step, t(x), t(v), t(sig), t(nxt), torch.from_numpy(a), s1, noise=t(z))
    for b in range(2):
        ref = {k: np_sde(x[k][b], v[k][b], sig[k][b], nxt[k][b], a[b], s1[k], z[k][b]) for k in shapes}
        sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
        joint = sum(ref[k][3] * sizes[k] for k in shapes) / sum(sizes.values())
        assert abs(out.log_prob[b].item() - joint) < 1e-12
        for k in shapes:
            np.testing.assert_allclose(out.sample[k][b].numpy(), ref[k][0], rtol=0, atol=1e-12)
            assert abs(out.std[k][b].item() - ref[k][2]) < 1e-12
            assert abs(out.dt[k][b].item() - (nxt[k][b] - sig[k][b])) < 1e-15
    # one σ for every entry (a plain tensor) gives a plain std, as before
    shared = step_latents(sde_step, t(x), t(v), t(sig)["video"], t(nxt)["video"], torch.from_numpy(a), 0.95, noise=t(z))
    assert isinstance(shared.std, torch.Tensor) and isinstance(shared.dt, torch.Tensor)


def test_kl_per_entry_std_and_flow_grpo_form():
    rng = np.random.default_rng(1)
    mean = {"video": rng.standard_normal((2, 6)), "audio": rng.standard_normal((2, 3))}
    ref = {k: m + 0.1 * rng.standard_normal(m.shape) for k, m in mean.items()}
    std = {"video": np.array([0.2, 0.0]), "audio": np.array([0.5, 0.4])}
    dt = {"video": np.array([-0.1, -0.2]), "audio": np.array([-0.3, -0.05])}
    t = lambda d: {k: torch.from_numpy(w) for k, w in d.items()}  # noqa: E731
    exact = kl_to_reference(t(mean), t(ref), t(std), t(dt), "exact")
    fg = kl_to_reference(t(mean), t(ref), t(std), t(dt), "flow_grpo")
    for b in range(2):
        num_e = num_f = 0.0
        for k in mean:
            if std[k][b] > 0:  # a deterministic entry-step contributes 0 (not a trained transition)
                sq = ((mean[k][b] - ref[k][b]) ** 2).sum() / (2 * std[k][b] ** 2)
                num_e += sq
                num_f += sq * -dt[k][b]
        assert abs(exact[b].item() - num_e / 9) < 1e-12
        assert abs(fg[b].item() - num_f / 9) < 1e-12
    # per-entry std equal to a shared std reproduces the shared form
    same = {k: torch.tensor([0.3, 0.6], dtype=torch.float64) for k in mean}
    assert torch.allclose(gaussian_mean_kl(t(mean), t(ref), same),
                          gaussian_mean_kl(t(mean), t(ref), torch.tensor([0.3, 0.6], dtype=torch.float64)), atol=0)
