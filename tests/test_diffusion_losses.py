"""The diffusion losses of docs/algorithms.md §3–4 against independent float64 references (numpy/scipy loops written
from the formulas), on hand-made and random inputs, gradients included."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import norm

from polyrl.actor.local import correction_weights, in_bounds
from polyrl.algorithms.diffusion_dpo import best_worst_pairs, dpo_loss
from polyrl.algorithms.diffusion_nft import nft_loss, old_decay
from polyrl.algorithms.diffusion_opd import distill_kl
from polyrl.algorithms.flow_dppo import dppo_loss
from polyrl.algorithms.grpo_guard import guard_log_ratio, inverse_dt_weights
from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.sampling.diffusion import SamplingPlan, draw_noise, rollout, window_starts


def t64(a):
    return torch.as_tensor(np.asarray(a, np.float64))


# ------------------------------------------------------------------------------------------------ GRPO-Guard
def ref_log_prob(x, mu, s):
    return np.array([norm.logpdf(x[i], mu[i], s[i]).mean() for i in range(x.shape[0])])


def test_guard_identity_corrected_log_ratio_is_mean_z_dmu():
    """x' = μ_old + s·z: log p_θ − log p_old = mean_d(z·Δμ)/s − mean_d Δμ²/(2s²); adding b cancels the second term
    and the ·s scaling leaves exactly log ρ̂ = mean_d(z ⊙ Δμ)."""
    rng = np.random.default_rng(0)
    b, d = 4, 24
    s = np.array([0.05, 0.2, 0.7, 1.3])
    mu_old = rng.normal(size=(b, d))
    dmu = rng.normal(size=(b, d)) * s[:, None] * 0.3
    z = rng.normal(size=(b, d))
    x = mu_old + s[:, None] * z
    lp, lp_old = ref_log_prob(x, mu_old + dmu, s), ref_log_prob(x, mu_old, s)
    got = guard_log_ratio(t64(lp), t64(lp_old), t64(mu_old + dmu), t64(mu_old), t64(s))
    np.testing.assert_allclose(got.numpy(), (z * dmu).mean(1), rtol=1e-9, atol=1e-13)
    # without the bias b the single-sample log-ratio is biased by −mean_d Δμ²/(2s²)
    np.testing.assert_allclose(lp - lp_old, (z * dmu).mean(1) / s - (dmu**2).mean(1) / (2 * s**2), rtol=1e-9)


def test_guard_gradient_wrt_current_mean():
    """d/dμ_θ of (log p_θ(x') − log p_old + b)·s = s·[(x'−μ_θ)/s² + (μ_θ−μ_old)/s²]/D = (x'−μ_old)/(s·D) = z/D."""
    rng = np.random.default_rng(1)
    b, d = 3, 10
    s = np.array([0.1, 0.5, 2.0])
    mu_old, z = rng.normal(size=(b, d)), rng.normal(size=(b, d))
    x = mu_old + s[:, None] * z
    mu = t64(mu_old + 0.01 * rng.normal(size=(b, d))).requires_grad_(True)
    s_t = t64(s)
    lp = (-(t64(x) - mu) ** 2 / (2 * s_t[:, None] ** 2) - torch.log(s_t)[:, None] - 0.5 * math.log(2 * math.pi)).mean(1)
    guard_log_ratio(lp, t64(ref_log_prob(x, mu_old, s)), mu, t64(mu_old), s_t).sum().backward()
    np.testing.assert_allclose(mu.grad.numpy(), z / d, rtol=1e-9)


def test_inverse_dt_weights_hand_values():
    # stored steps: dt = −0.1, −0.3 (sample 0) and −0.2, −0.4 (sample 1): 1/(−dt) = 10, 3.33, 5, 2.5; the grid
    # 1 > 0.9 > 0.6 > 0.2 > 0 has 1/(−dt) = 10, 3.33, 2.5, 5: mean 5.2083, the normaliser of every sample
    sigmas = t64([[1.0, 0.9, 0.6], [0.6, 0.2, 0.0]])
    grid = t64([1.0, 0.9, 0.6, 0.2, 0.0])
    inv = np.array([[10.0, 1 / 0.3], [2.5, 5.0]])
    norm = np.mean([10.0, 1 / 0.3, 2.5, 5.0])
    for k in range(2):
        np.testing.assert_allclose(inverse_dt_weights(sigmas, k, grid).numpy(), inv[:, k] / norm, rtol=1e-12)
        # a sample's weight is the same alone as beside others (no micro-batch statistic)
        np.testing.assert_allclose(inverse_dt_weights(sigmas[1:], k, grid).numpy(), inv[1:, k] / norm, rtol=1e-12)


# ------------------------------------------------------------------------------------------------ Flow-DPPO
def test_dppo_hand_cases_and_gradient():
    # D = mean_d Δμ²/(2s²): sample 0 tiny (kept), samples 1–3 large; 1 moves away (ρ>1, A>0: dropped),
    # 2 moves back (ρ>1, A<0: kept), 3 moves away (ρ<1, A<0: dropped)
    s = t64([1.0, 1.0, 1.0, 1.0])
    mean = t64([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    old_mean = t64([[1e-4, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    adv = t64([1.0, 2.0, -1.0, -1.0])
    old = t64([0.0, 0.0, 0.0, 0.0])
    log_ratio = np.array([0.01, 0.2, 0.1, -0.3])
    lp = t64(log_ratio).requires_grad_(True)
    loss, ratio, keep, div = dppo_loss(lp, old, mean, old_mean, s, adv, tau=1e-5)
    np.testing.assert_allclose(div.numpy(), [(1e-8 / 2) / 2, 0.5, 0.5, 0.5], rtol=1e-12)
    assert keep.tolist() == [True, False, True, False]
    rho = np.exp(log_ratio)
    expected = np.array([-1.0 * rho[0], 0.0, 1.0 * rho[2], 0.0])
    assert loss.item() == pytest.approx(expected.mean(), rel=1e-12)
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), expected / 4, rtol=1e-12)  # d(−Aρ)/d log p = −Aρ


def test_dppo_random_against_reference_loop():
    rng = np.random.default_rng(2)
    b, d = 16, 8
    s = rng.uniform(0.01, 0.1, size=b)
    mean, old_mean = rng.normal(size=(b, d)), rng.normal(size=(b, d))
    old_mean = mean + rng.normal(size=(b, d)) * s[:, None] * rng.choice([1e-4, 1.0], size=(b, 1))
    adv, old, lr = rng.normal(size=b), rng.normal(size=b), rng.normal(size=b) * 0.01
    loss, _, keep, _ = dppo_loss(t64(old + lr), t64(old), t64(mean), t64(old_mean), t64(s), t64(adv), 1e-5,
                                 weight=t64(np.linspace(0.5, 1.5, b)))
    ref = []
    for i in range(b):
        dist = np.mean((mean[i] - old_mean[i]) ** 2) / (2 * s[i] ** 2)
        rho = math.exp(lr[i])
        drop = dist >= 1e-5 and ((rho > 1 and adv[i] > 0) or (rho < 1 and adv[i] < 0))
        ref.append(0.0 if drop else -adv[i] * rho * np.linspace(0.5, 1.5, b)[i])
        assert keep[i].item() == (not drop)
    assert 0 < keep.sum() < b  # the case mixes kept and dropped sample-steps
    assert loss.item() == pytest.approx(np.mean(ref), rel=1e-12)


# ------------------------------------------------------------------------------------------------ DiffusionNFT
def ref_nft(v_theta, v_old, x_t, x0, t, adv, c, beta):
    """Per-sample loss in plain numpy, written from §3 DiffusionNFT."""
    out = []
    for i in range(x0.shape[0]):
        p = min(max(adv[i], -c), c) / (2 * c) + 0.5
        vp = beta * v_theta[i] + (1 - beta) * v_old[i]
        vn = (1 + beta) * v_old[i] - beta * v_theta[i]
        xp, xn = x_t[i] - t[i] * vp, x_t[i] - t[i] * vn
        wp, wn = max(np.abs(xp - x0[i]).mean(), 1e-5), max(np.abs(xn - x0[i]).mean(), 1e-5)
        out.append(c * (p * ((xp - x0[i]) ** 2).mean() / wp + (1 - p) * ((xn - x0[i]) ** 2).mean() / wn) / beta)
    return np.array(out)


def _nft_inputs(seed=3, b=5, shape=(2, 3, 3)):
    rng = np.random.default_rng(seed)
    x0, eps = rng.normal(size=(b, *shape)), rng.normal(size=(b, *shape))
    t = rng.uniform(0.05, 0.95, size=b)
    x_t = (1 - t.reshape(-1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1) * eps
    v_old = (eps - x0) + 0.3 * rng.normal(size=x0.shape)
    v_theta = v_old + 0.05 * rng.normal(size=x0.shape)
    adv = np.array([-7.0, -1.0, 0.0, 2.5, 6.0])  # includes values beyond ±C
    return v_theta, v_old, x_t, x0, t, adv


def test_nft_loss_matches_reference():
    v_theta, v_old, x_t, x0, t, adv = _nft_inputs()
    got, _ = nft_loss(t64(v_theta), t64(v_old), t64(x_t), t64(x0), t64(t), t64(adv), 5.0, 0.1)
    np.testing.assert_allclose(got.numpy(), ref_nft(v_theta, v_old, x_t, x0, t, adv, 5.0, 0.1), rtol=1e-10)


def test_nft_loss_gradient_with_stopped_weights():
    v_theta, v_old, x_t, x0, t, adv = _nft_inputs(seed=4)
    c, beta = 5.0, 0.1
    vt = t64(v_theta).requires_grad_(True)
    got, _ = nft_loss(vt, t64(v_old), t64(x_t), t64(x0), t64(t), t64(adv), c, beta)
    got.sum().backward()
    d = x0[0].size
    expected = np.zeros_like(v_theta)
    for i in range(x0.shape[0]):  # w^± are constants; d x̂0⁺/d v_θ = −tβ, d x̂0⁻/d v_θ = +tβ
        p = min(max(adv[i], -c), c) / (2 * c) + 0.5
        ep = x_t[i] - t[i] * (beta * v_theta[i] + (1 - beta) * v_old[i]) - x0[i]
        en = x_t[i] - t[i] * ((1 + beta) * v_old[i] - beta * v_theta[i]) - x0[i]
        wp, wn = np.abs(ep).mean(), np.abs(en).mean()
        expected[i] = c / beta * (p * 2 * ep * (-t[i] * beta) / (d * wp) + (1 - p) * 2 * en * (t[i] * beta) / (d * wn))
    np.testing.assert_allclose(vt.grad.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_nft_pushes_toward_positive_velocity_for_positive_advantage():
    """A = +C (p = 1): the loss is the x̂0⁺ error, minimised at v_θ where v⁺ = the true velocity ε − x0."""
    v_theta, v_old, x_t, x0, t, _ = _nft_inputs(seed=5)
    adv = np.full(5, 5.0)
    vt = t64(v_theta).requires_grad_(True)
    loss, _ = nft_loss(vt, t64(v_old), t64(x_t), t64(x0), t64(t), t64(adv), 5.0, 0.1)
    loss.sum().backward()
    step = vt.detach() - 1e-3 * vt.grad
    after, _ = nft_loss(step, t64(v_old), t64(x_t), t64(x0), t64(t), t64(adv), 5.0, 0.1)
    assert after.sum() < loss.sum()


def test_old_decay_schedules():
    assert [old_decay(u, 0.0, 0.0, 0, 0.999) for u in (0, 50, 500)] == [0.0, 0.0, 0.0]  # copy
    assert old_decay(10, 0.9, 0.0, 0, 0.999) == 0.9  # constant EMA
    ramp = [old_decay(u, 0.0, 0.0075, 75, 0.999) for u in (0, 75, 100, 300)]
    np.testing.assert_allclose(ramp, [0.0, 0.0, 0.1875, 0.999])


# ------------------------------------------------------------------------------------------------ Diffusion-DPO
def test_dpo_loss_hand_values_and_gradient():
    beta = 100.0
    e_w = t64([0.30, 0.10]).requires_grad_(True)
    e_l = t64([0.20, 0.20])
    r_w, r_l = t64([0.30, 0.15]), t64([0.20, 0.18])
    loss, z = dpo_loss(e_w, e_l, r_w, r_l, beta)
    # pair 0: z = −50·(0 − 0) = 0 → log 2; pair 1: z = −50·(−0.05 − 0.02) = 3.5
    np.testing.assert_allclose(z.detach().numpy(), [0.0, 3.5], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(loss.detach().numpy(), [math.log(2), math.log1p(math.exp(-3.5))], rtol=1e-12)
    loss.sum().backward()
    # dL/de_w = −σ(−z)·dz/de_w = σ(−z)·β/2
    sig = 1 / (1 + np.exp(np.array([0.0, 3.5])))
    np.testing.assert_allclose(e_w.grad.numpy(), sig * beta / 2, rtol=1e-12)


def test_best_worst_pairs():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.3, 0.7, 0.2, 0.2])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    win, lose = best_worst_pairs(rewards, groups)
    assert win.tolist() == [1, 5] and lose.tolist() == [0, 6]  # group 1 has equal rewards: no pair


# ------------------------------------------------------------------------------------------------ OPD, correction
def test_distill_kl_is_the_gaussian_kl_to_the_teacher():
    rng = np.random.default_rng(6)
    mean, teacher = rng.normal(size=(3, 12)), rng.normal(size=(3, 12))
    s = np.array([0.1, 0.4, 0.0])  # the last step is deterministic: no KL
    got = distill_kl(t64(mean), t64(teacher), t64(s)).numpy()
    for i in range(2):
        # KL(N(μ, s²) ‖ N(μ_T, s²)) by numerical integration of one element, then the mean over elements
        kls = []
        for j in range(12):
            xs = mean[i, j] + np.linspace(-12, 12, 200001) * s[i]
            p = norm.pdf(xs, mean[i, j], s[i])
            kls.append(np.trapezoid(p * (norm.logpdf(xs, mean[i, j], s[i]) - norm.logpdf(xs, teacher[i, j], s[i])), xs))
        assert got[i] == pytest.approx(np.mean(kls), rel=1e-6)
    assert got[2] == 0.0


def test_decoupled_weights_are_truncated_and_masked():
    old = t64([0.0, 0.5, 2.0, -0.2])
    rollout_lp = t64([0.0, 0.0, 0.0, 0.0])
    w, mask = correction_weights(old, rollout_lp, 2.0, (-0.1, 1.0))
    np.testing.assert_allclose(w.numpy(), [1.0, math.exp(0.5), 2.0, math.exp(-0.2)], rtol=1e-12)
    assert mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert in_bounds(t64([5.0]), None).tolist() == [1.0]


# ------------------------------------------------------------------------------------------------ windows, noise
def test_window_strategies():
    plan = SamplingPlan(num_steps=10, shape=MediaShape(8, 8), guidance=Guidance(1.0), noise_level=0.7, window_size=3,
                        window_range=(0, 4), window_strategy="per_sample")
    g = torch.Generator().manual_seed(0)
    per = window_starts(plan, 256, g)
    assert per.min() == 0 and per.max() == 4 and len(set(per.tolist())) == 5
    assert torch.equal(per, window_starts(plan, 256, torch.Generator().manual_seed(0)))  # seeded
    rnd = window_starts(SamplingPlan(**{**plan.__dict__, "window_strategy": "random"}), 8, g)
    assert len(set(rnd.tolist())) == 1 and 0 <= rnd[0] <= 4
    prog = SamplingPlan(**{**plan.__dict__, "window_strategy": "progressive", "window_every": 2})
    starts = [int(window_starts(prog, 4, g, step)[0]) for step in range(12)]
    # slides by W = 3 every 2 steps, modulo the 5 positions of [0, 4]
    assert starts == [0, 0, 3, 3, 1, 1, 4, 4, 2, 2, 0, 0]


class ZeroVelocity:
    """A stand-in adapter whose network predicts v = 0: an ODE rollout keeps the initial noise."""

    device = torch.device("cpu")

    def encode_prompts(self, prompts):
        return {"pooled": torch.zeros(len(prompts), 1)}

    def encode_guidance(self, guidance):
        return {}

    def latent_shapes(self, shape):
        return {"x": (2, shape.height, shape.width)}

    def sigmas(self, num_steps, shape):
        return torch.linspace(1, 0, num_steps + 1)

    def velocity(self, latents, sigma, cond, shared, guidance):
        return {k: torch.zeros_like(v) for k, v in latents.items()}


@pytest.mark.parametrize("shared", [True, False])
def test_shared_initial_noise_per_group_and_stored_means(shared):
    plan = SamplingPlan(num_steps=4, shape=MediaShape(3, 3), guidance=Guidance(1.0), noise_level=0.5, window_size=2,
                        window_range=(1, 1), shared_noise=shared)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    model = ZeroVelocity()
    noise = draw_noise(model.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(0))
    out = rollout(model, ["a"] * 6, [{}] * 6, groups, plan, noise, decode=False)
    x0 = out.latents["x"][:, 0]  # state at step 1 = the initial noise (step 0 is an ODE step with v = 0)
    assert torch.equal(x0[0], x0[1]) == shared and torch.equal(x0[3], x0[5]) == shared
    assert not torch.equal(x0[0], x0[3])
    # the stored means are the transition means of the window: for v = 0 the sde mean is x·(1 + std²·dt/(2σ))
    assert out.old_means["x"].shape == (6, 2, 2, 3, 3)
    sigma, sigma_next = 0.75, 0.5
    std2 = 0.5**2 * sigma / (1 - sigma)
    np.testing.assert_allclose(out.old_means["x"][:, 0].numpy(), (x0 * (1 + std2 * (sigma_next - sigma) / (2 * sigma))).numpy(),
                               rtol=1e-6)


class HalfVelocity(ZeroVelocity):
    def velocity(self, latents, sigma, cond, shared, guidance):
        return {k: 0.5 * v for k, v in latents.items()}


def test_chunks_read_their_noise_as_views_and_each_hands_on_its_rows():
    """A chunk's draws are views into the step's noise (`RolloutNoise.select` with a slice: on a GPU the pinned
    memory stays pinned, so its copies are queued without waiting), which sampling must not write into; the batch
    sampled in 3 chunks equals the one sampled in 1, and each chunk given to the reward stage holds its own rows."""
    plan = SamplingPlan(num_steps=4, shape=MediaShape(3, 3), guidance=Guidance(1.0), noise_level=0.5, window_size=2,
                        window_range=(0, 2), batch_size=6)
    groups = torch.arange(6)
    noise = draw_noise({"x": (2, 3, 3)}, plan, groups, torch.Generator().manual_seed(0))
    before = copy.deepcopy(noise)
    view, copied = noise.select(slice(2, 4)), noise.select(torch.arange(2, 4))
    assert view.steps["x"].data_ptr() == noise.steps["x"][:, 2].data_ptr()
    assert torch.equal(view.steps["x"], copied.steps["x"]) and torch.equal(view.initial["x"], copied.initial["x"])

    class Sink(list):
        put = list.append

    whole = rollout(HalfVelocity(), ["a"] * 6, [{}] * 6, groups, plan, noise, decode=False)
    chunks = Sink()
    parts = rollout(HalfVelocity(), ["a"] * 6, [{}] * 6, groups, replace(plan, batch_size=2), noise, decode=False,
                    sink=chunks)
    assert all(torch.equal(getattr(noise, f)["x"], getattr(before, f)["x"]) for f in ("initial", "steps"))
    for name in ("latents", "final", "old_means", "cond"):
        assert all(torch.equal(getattr(whole, name)[k], getattr(parts, name)[k]) for k in getattr(whole, name))
    for name in ("log_probs", "sigmas", "noise_levels"):
        assert torch.equal(getattr(whole, name), getattr(parts, name))
    assert [c.index for c in chunks] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    for c in chunks:
        assert torch.equal(c.final["x"], whole.final["x"][c.index])


class GradModeSpy(ZeroVelocity):
    """Records, per network call, whether autograd was on; counts FLOPs as the adapters do (×3 under autograd)."""

    def __init__(self):
        self.network = torch.nn.Linear(1, 1).eval()
        self.weight = torch.ones((), requires_grad=True)
        self.grad_modes, self.flops = [], 0.0

    def modules(self):
        return {"transformer": self.network}

    def velocity(self, latents, sigma, cond, shared, guidance):
        assert self.network.training == torch.is_grad_enabled()  # as in training: autograd on, train mode
        self.grad_modes.append(torch.is_grad_enabled())
        self.flops += 10.0 * (3 if torch.is_grad_enabled() else 1)
        return {k: v * 0 * self.weight for k, v in latents.items()}


@pytest.mark.parametrize("training_graph", [True, False])
def test_training_graph_runs_every_step_under_autograd(training_graph):
    """rollout.training_graph: every step calls the network with autograd on and in train mode (the graph training
    compiles; the untrained steps too, so that no no-grad twin is compiled for them), none without it; nothing sampled
    keeps a graph, the network is back in eval mode, and the FLOPs count one forward per call."""
    plan = SamplingPlan(num_steps=6, shape=MediaShape(3, 3), guidance=Guidance(1.0), noise_level=0.5, window_size=2,
                        window_range=(1, 2), training_graph=training_graph)
    groups = torch.tensor([0, 0, 1, 1])
    noise = draw_noise({"x": (2, 3, 3)}, plan, groups, torch.Generator().manual_seed(0))
    noise.starts = torch.tensor([1, 1, 2, 2])  # windows cover steps 1-2 and 2-3
    model = GradModeSpy()
    out = rollout(model, ["a"] * 4, [{}] * 4, groups, plan, noise, decode=False)
    assert model.grad_modes == [training_graph] * 6
    assert model.flops == 60.0
    assert not out.log_probs.requires_grad and not out.latents["x"].requires_grad and not out.final["x"].requires_grad
    assert not model.network.training


def test_training_graph_with_unequal_call_sizes_warns(tmp_path, capsys):
    """rollout.training_graph needs a sampling call and a training micro-batch of the same size to be exact: the run
    says so when they differ, and not when they are equal."""
    from polyrl.config import load_config
    from polyrl.trainer.loop import Trainer

    def warnings(batch_size: int) -> str:
        cfg = load_config(["rollout.training_graph=true", f"rollout.batch_size={batch_size}", "actor.micro_batch_size=4",
                           f"trainer.output_dir={tmp_path / str(batch_size)}", "trainer.progress=false"])
        Trainer(cfg).close()
        return capsys.readouterr().err

    assert ("polyrl: warning: rollout.training_graph=true runs training's graph, but rollout.batch_size=8 against 4 "
            "samples per training micro-batch") in warnings(8)
    assert "rollout.training_graph" not in warnings(4)

