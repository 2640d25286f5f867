"""Peer-exact losses (docs/algorithms.md §3 OPD, §5; docs/tokens.md "Losses"): polyrl's token PPO-style losses and
diffusion distillation KL against float64 references written from the peers' math (numpy loops, one element at a
time), gradients included:

* verl's `compute_policy_loss_vanilla` with its `agg_loss` (verl-project/verl verl/trainer/ppo/core_algos.py at
  1dda039b9c6311889a9c9a26040677e1254814f9): PPO-clip, the dual clip `clip_ratio_c` (default 3), rollout weights,
  `token-mean` / `seq-mean-token-mean`; it is the loss of verl's GRPO / DAPO and of its OPD (`distillation/losses.py`
  passes the advantage −k1 to it);
* verl's `compute_policy_loss_gspo` (same file): no dual clip, log s_t clamped at 10;
* verl-omni's `DistillKLLoss` (verl-project/verl-omni verl_omni/trainer/diffusion/diffusion_algos.py at
  a1139bafffb5b9711f0a6b6edff8ecaa60bfff30) with the std_dev_t its scheduler's `sde` / `cps` / `dance_sde` steps
  return (verl_omni/pipelines/schedulers/flow_match_sde.py).

Two conventions of verl's aggregation that polyrl does not copy, and which the references take as parameters: the
1e-8 verl adds to each sequence's token count in `seq-mean-token-mean` (a relative 1e-8/n_i, compared separately
below) and its leaving fully masked sequences out of the mean (every response here has a token, as every rollout's
does: its EOS or first token). verl's clamp of the log-ratio to ±20 (vanilla) or ≤ 10 (GSPO) is in the references
and never binds on these inputs (|log ρ| < 4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.algorithms import build_algorithm
from polyrl.algorithms.diffusion_opd import distill_kl
from polyrl.algorithms.opd_tokens import opd_loss
from polyrl.algorithms.token_losses import gspo_loss, token_ppo_loss
from polyrl.batch import Rollout
from polyrl.sampling.steps import STEPS, step_latents

F64 = torch.float64
VERL_EPS = 1e-8  # verl's `seq-mean-token-mean` denominator: Σ_t m / (n_i + 1e-8)


def _inputs(seed: int, b: int = 5, r: int = 7):
    """Random log-probs with log-ratios of std 1 (some ρ > 3 and some < 0.8), mixed-sign advantages, ragged
    masks (every row has ≥ 1 token), rollout-correction weights in [0, 1.5] with one rejected token (weight 0)."""
    rng = np.random.default_rng(seed)
    lp = rng.normal(-2.0, 1.0, (b, r))
    old = lp - rng.normal(0.0, 1.0, (b, r))
    adv = np.array([1.3, -0.9, -2.0, 0.4, -0.2])[:b]
    lengths = rng.integers(1, r + 1, b)
    mask = (np.arange(r)[None, :] < lengths[:, None]).astype(float)
    weight = rng.uniform(0.0, 1.5, (b, r))
    weight[1, 0] = 0.0
    return lp, old, adv, mask, weight


def verl_vanilla(lp, old, adv, mask, lo, hi, c, agg, weight=None, eps=VERL_EPS):
    """verl's vanilla policy loss, element by element: Δ = clamp(log π − log π_old, −20, 20), ρ = e^Δ,
    ℓ = max(−A·ρ, −A·clip(ρ, 1 − lo, 1 + hi)), for A < 0 ℓ = min(ℓ, −A·c) (dual clip; c None: skipped), ℓ·w;
    token-mean Σ m·ℓ / Σ m, seq-mean-token-mean mean_i [Σ_t m·ℓ / (n_i + eps)] over rows with n_i > 0.
    `adv` is (B,) per sequence or (B, R) per token. Returns (loss, dloss/dlog π, dual-capped count)."""
    b, r = lp.shape
    adv = np.broadcast_to(np.asarray(adv, float).reshape(b, -1), (b, r))
    w = np.ones((b, r)) if weight is None else weight
    per, dper, capped = np.zeros((b, r)), np.zeros((b, r)), 0
    for i in range(b):
        for t in range(r):
            a, delta = adv[i, t], min(max(lp[i, t] - old[i, t], -20.0), 20.0)
            rho = math.exp(delta)
            l1, l2 = -a * rho, -a * min(max(rho, 1 - lo), 1 + hi)
            loss, grad = (l1, -a * rho) if l1 >= l2 else (l2, 0.0)
            if c is not None and a < 0 and loss > -a * c:
                loss, grad = -a * c, 0.0
                capped += int(mask[i, t] > 0)
            per[i, t], dper[i, t] = loss * w[i, t], grad * w[i, t]
    n = mask.sum(1)
    if agg == "token_mean":
        return (per * mask).sum() / n.sum(), dper * mask / n.sum(), capped
    rows = n > 0
    scale = mask / (n[:, None] + eps) / rows.sum()
    return ((per * mask).sum(1) / (n + eps))[rows].mean(), dper * scale, capped


def verl_gspo(lp, old, adv, mask, lo, hi, weight=None, eps=VERL_EPS, c=None):
    """verl's GSPO loss: log s_i = Σ_t m·(log π − log π_old) / max(n_i, 1); every token carries log s_t = min(log s_i,
    10) in value and ∂ log s_t/∂ log π_t = 1; ℓ_t = max(−A_i·s_t, −A_i·clip(s_t, 1 − lo, 1 + hi))·w, seq-mean-token-mean.
    `c` (not in verl) caps ℓ at −A_i·c where A_i < 0, polyrl's option. Returns (loss, dloss/dlog π)."""
    b, r = lp.shape
    w = np.ones((b, r)) if weight is None else weight
    per, dper = np.zeros((b, r)), np.zeros((b, r))
    n = mask.sum(1)
    for i in range(b):
        log_s = min((mask[i] * (lp[i] - old[i])).sum() / max(n[i], 1.0), 10.0)
        s, a = math.exp(log_s), adv[i]
        l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        loss, grad = (l1, -a * s) if l1 >= l2 else (l2, 0.0)
        if c is not None and a < 0 and loss > -a * c:
            loss, grad = -a * c, 0.0
        per[i], dper[i] = loss * w[i], grad * w[i]
    rows = n > 0
    return ((per * mask).sum(1) / (n + eps))[rows].mean(), dper * mask / (n[:, None] + eps) / rows.sum()


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


@pytest.mark.parametrize("agg, lo, hi", [("seq_mean_token_mean", 0.2, 0.2), ("token_mean", 0.2, 0.28)])
def test_grpo_and_dapo_token_loss_equal_verls_vanilla_loss(agg, lo, hi):
    """GRPO (seq-mean-token-mean, ε 0.2) and DAPO (token-mean, clip-higher 0.28) with the dual clip at verl's 3 and
    rollout weights: loss and gradient equal verl's in float64; without the cap (c = None) they equal verl's loss at
    c = ∞, and the cap moves the loss (the inputs have A < 0 tokens with ρ > 3)."""
    lp, old, adv, mask, weight = _inputs(0)
    eps = 0.0 if agg == "seq_mean_token_mean" else VERL_EPS  # token-mean has no ε in verl
    for c in (None, 3.0):
        want, want_grad, n_capped = verl_vanilla(lp, old, adv, mask, lo, hi, c, agg, weight, eps=eps)
        x = torch.tensor(lp, dtype=F64, requires_grad=True)
        loss, ratio, clipped, capped = token_ppo_loss(x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), lo,
                                                      hi, torch.tensor(weight), agg, clip_ratio_c=c)
        loss.backward()
        assert _rel(loss.item(), want) < 1e-14
        np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-13, atol=1e-17)
        assert int((capped & torch.tensor(mask > 0)).sum()) == n_capped
        if c is not None:
            assert n_capped >= 2 and bool((clipped & torch.tensor(mask > 0)).any())
            uncapped = verl_vanilla(lp, old, adv, mask, lo, hi, None, agg, weight, eps=eps)[0]
            assert abs(want - uncapped) > 1e-2  # the dual clip is exercised: dropping it would fail the test
    if agg == "seq_mean_token_mean":  # verl's 1e-8 in each sequence's token count: a relative difference ≤ 1e-8
        verl = verl_vanilla(lp, old, adv, mask, lo, hi, 3.0, agg, weight)[0]
        assert 1e-12 < _rel(verl, want) < 1e-8


def test_token_opd_loss_equals_verls_distillation_policy_gradient():
    """verl's OPD with use_policy_gradient: vanilla loss on A_t = −clamp(log π_θ − log π_T, ±c_kl), dual clip 3."""
    lp, old, _, mask, weight = _inputs(0)
    teacher = lp + np.random.default_rng(3).normal(0.0, 6.0, lp.shape)  # 4 tokens with |k1| > 10: the clamp binds
    adv = -np.clip(lp - teacher, -10.0, 10.0)
    for agg in ("seq_mean_token_mean", "token_mean"):
        want, want_grad, n_capped = verl_vanilla(lp, old, adv, mask, 0.2, 0.2, 3.0, agg, weight, eps=0.0)
        x = torch.tensor(lp, dtype=F64, requires_grad=True)
        loss, _, _, capped, k1 = opd_loss(x, torch.tensor(old), torch.tensor(teacher), torch.tensor(mask), 0.2, 0.2,
                                          10.0, torch.tensor(weight), agg, clip_ratio_c=3.0)
        loss.backward()
        assert _rel(loss.item(), want) < 1e-14 and n_capped >= 2
        np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-13, atol=1e-17)
        assert int((capped & torch.tensor(mask > 0)).sum()) == n_capped
        np.testing.assert_array_equal(k1.numpy(), np.clip(lp - teacher, -10.0, 10.0))


@pytest.mark.parametrize("lo, hi", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_loss_equals_verls_gspo_loss(lo, hi):
    """GSPO's default (no dual clip) is verl's `compute_policy_loss_gspo`; with c, the cap on the sequence ratio."""
    lp, old, adv, mask, weight = _inputs(3)
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    loss, s, clipped, capped = gspo_loss(x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), lo, hi,
                                         torch.tensor(weight))
    loss.backward()
    want, want_grad = verl_gspo(lp, old, adv, mask, lo, hi, weight, eps=0.0)
    assert _rel(loss.item(), want) < 1e-14 and not capped.any()
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-13, atol=1e-17)
    if lo == 0.2:  # a sequence with A < 0 and s > 1.05 exists: a cap of 1.05 binds on it
        c = 1.05
        x = torch.tensor(lp, dtype=F64, requires_grad=True)
        loss, _, _, capped = gspo_loss(x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), lo, hi,
                                       torch.tensor(weight), clip_ratio_c=c)
        loss.backward()
        want_c, want_grad_c = verl_gspo(lp, old, adv, mask, lo, hi, weight, eps=0.0, c=c)
        assert capped.any() and abs(want_c - want) > 1e-3
        assert _rel(loss.item(), want_c) < 1e-14
        np.testing.assert_allclose(x.grad.numpy(), want_grad_c, rtol=1e-13, atol=1e-17)


def test_dual_clip_defaults_and_errors():
    """verl's default 3 for the vanilla-loss algorithms; GSPO none, as verl's GSPO loss; c must be > 1 or null."""
    assert [build_algorithm({"name": n}).clip_ratio_c for n in ("grpo", "dapo", "gspo")] == [3.0, 3.0, None]
    opd = build_algorithm({"name": "opd", "teacher_path": "/t", "task_loss": "grpo"})
    assert opd.clip_ratio_c == 3.0 and opd.task.clip_ratio_c == 3.0
    assert build_algorithm({"name": "grpo", "clip_ratio_c": None}).clip_ratio_c is None
    for bad in (1.0, 0.5, "3"):
        with pytest.raises(ValueError, match=r"algorithm.clip_ratio_c=.* must be a number > 1 or null"):
            build_algorithm({"name": "dapo", "clip_ratio_c": bad})


# --------------------------------------------------------------------------------- diffusion distillation KL
def verl_omni_step(kind, x, v, sigma, sigma_next, a, sigma_max):
    """(mean, std_dev_t) of verl-omni's scheduler step, per sample (rows of x): `sde` std_dev_t = a·sqrt(σ/(1 − σ̃)),
    σ̃ = σ_max where σ = 1; `cps` σ'·sin(aπ/2); `dance` (its `dance_sde`) η·sqrt(σ − σ'), η = a."""
    means, stds = [], []
    for i in range(x.shape[0]):
        s, s2, dt = sigma[i], sigma_next[i], sigma_next[i] - sigma[i]
        if kind == "sde":
            std = math.sqrt(s / (1 - (sigma_max if s == 1 else s))) * a[i]
            mean = x[i] * (1 + std**2 / (2 * s) * dt) + v[i] * (1 + std**2 * (1 - s) / (2 * s)) * dt
        elif kind == "cps":
            std = s2 * math.sin(a[i] * math.pi / 2)
            mean = (x[i] - s * v[i]) * (1 - s2) + (x[i] + v[i] * (1 - s)) * math.sqrt(s2**2 - std**2)
        else:
            x0 = x[i] - s * v[i]
            score = -(x[i] - x0 * (1 - s)) / s**2
            mean = x[i] + dt * v[i] + (-0.5 * a[i] ** 2 * score) * dt
            std = a[i] * math.sqrt(s - s2)
        means.append(mean)
        stds.append(std)
    return np.stack(means), np.array(stds)


def verl_omni_distill_kl(mean, teacher_mean, std_dev_t):
    """verl-omni's DistillKLLoss per sample: mean over the sample's elements of (μ − μ_T)², / (2·std_dev_t²)."""
    return np.array([((mean[i] - teacher_mean[i]) ** 2).mean() / (2 * std_dev_t[i] ** 2) for i in range(len(mean))])


SIGMA = np.array([1.0, 0.8, 0.5, 0.3])
SIGMA_NEXT = np.array([0.9, 0.6, 0.3, 0.1])
LEVEL = np.array([0.7, 0.5, 0.9, 0.6])
SIGMA_MAX = 0.9


def _states(seed, b=4):
    rng = np.random.default_rng(seed)
    x, v = rng.normal(size=(b, 3, 4, 4)), rng.normal(size=(b, 3, 4, 4))
    return x, v, v + 0.05 * rng.normal(size=v.shape), rng.normal(size=x.shape)


def _polyrl_step(kind, x, v, prev=None, noise=None, rows=slice(None)):
    t = lambda a: torch.tensor(a[rows], dtype=F64)  # noqa: E731
    return step_latents(STEPS[kind], {"x": t(x)}, {"x": t(v)}, t(SIGMA), t(SIGMA_NEXT), t(LEVEL), SIGMA_MAX,
                        noise=None if noise is None else {"x": t(noise)}, prev=prev)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_distill_kl_forms_equal_verl_omnis(kind):
    """distill_kl_form=verl_omni is verl-omni's DistillKLLoss on the same transition (the means equal its
    scheduler's); `exact` is it × 1/(−dt) on `sde` and equal on `cps` / `dance`; `flow_grpo` × (−dt) on `dance`."""
    x, v, v_teacher, z = _states(0)
    out = _polyrl_step(kind, x, v, noise=z)
    teacher = _polyrl_step(kind, x, v_teacher, prev=out.sample)
    mean, std_dev_t = verl_omni_step(kind, x, v, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_MAX)
    mean_t, _ = verl_omni_step(kind, x, v_teacher, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_MAX)
    np.testing.assert_allclose(out.mean["x"].numpy(), mean, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(teacher.mean["x"].numpy(), mean_t, rtol=1e-13, atol=1e-15)
    want = verl_omni_distill_kl(mean, mean_t, std_dev_t)
    forms = {f: distill_kl(out.mean, teacher.mean, out.std, out.dt, f, out.step).numpy()
             for f in ("verl_omni", "exact", "flow_grpo")}
    np.testing.assert_allclose(forms["verl_omni"], want, rtol=1e-13, atol=0)
    minus_dt = SIGMA - SIGMA_NEXT
    np.testing.assert_allclose(forms["exact"] * (minus_dt if kind == "sde" else 1), want, rtol=1e-13, atol=0)
    np.testing.assert_allclose(forms["flow_grpo"], want * (minus_dt if kind == "dance" else 1), rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="algorithm.distill_kl_form='nope'; allowed: exact, flow_grpo, verl_omni"):
        build_algorithm({"name": "diffusion_opd", "teacher_path": "/t", "distill_kl_form": "nope"})


class _Policy:
    """The PolicyEvaluator the loss sees: the student's velocity v, teacher j's v + δ_j, on the batch's stored
    states (so a sub-batch `select`ed for a keyed teacher gets its own rows)."""

    def __init__(self, kind, v, deltas):
        self.kind, self.v, self.deltas = kind, v, deltas

    def step(self, batch, k, policy="current"):
        rows = batch.group_ids.numpy()
        v = self.v if policy == "current" else self.v + self.deltas[int(policy.split(":")[1])]
        x = batch.latents["x"][:, k]
        return step_latents(STEPS[self.kind], {"x": x}, {"x": torch.tensor(v[rows])}, batch.sigmas[:, k],
                            batch.sigmas[:, k + 1], batch.noise_levels[:, k], SIGMA_MAX,
                            prev={"x": batch.latents["x"][:, k + 1]})


def test_multi_teacher_kl_keeps_float64_and_takes_the_form():
    """Two keyed teachers and one key-less, float64 states: the loss is Σ_j w_j·m_ji·KL_j,i in verl-omni's form,
    averaged, and stays float64 (the per-teacher buffer was float32 whatever the input)."""
    x, v, _, z = _states(1)
    rng = np.random.default_rng(2)
    deltas = [0.05 * rng.normal(size=v.shape) for _ in range(3)]
    x1 = _polyrl_step("sde", x, v, noise=z).sample["x"]
    batch = Rollout(prompts=["p"] * 4, metadata=[{"teacher": "a"}, {"teacher": "b"}, {}, {"teacher": "a"}],
                    group_ids=torch.arange(4), cond={}, shared={},
                    latents={"x": torch.stack([torch.tensor(x), x1], 1)}, log_probs=torch.zeros(4, 1, dtype=F64),
                    sigmas=torch.tensor(np.stack([SIGMA, SIGMA_NEXT], 1)), noise_levels=torch.tensor(LEVEL[:, None]),
                    final={"x": torch.zeros(4, 3, 4, 4, dtype=F64)})
    teachers = [{"path": "/a", "weight": 2.0, "key": "a"}, {"path": "/b", "weight": 0.5, "key": "b"}, {"path": "/c"}]
    algo = build_algorithm({"name": "diffusion_opd", "teachers": teachers, "distill_kl_form": "verl_omni"})
    loss, stats = algo.step_loss(_Policy("sde", v, deltas), algo.prepare(batch), 0)
    mean, std_dev_t = verl_omni_step("sde", x, v, SIGMA, SIGMA_NEXT, LEVEL, SIGMA_MAX)
    routes = [[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]]
    want = np.zeros(4)
    for j, (w, m) in enumerate(zip([2.0, 0.5, 1.0], routes, strict=True)):
        mean_t, _ = verl_omni_step("sde", x, v + deltas[j], SIGMA, SIGMA_NEXT, LEVEL, SIGMA_MAX)
        want += w * np.array(m) * verl_omni_distill_kl(mean, mean_t, std_dev_t)
    assert loss.dtype == F64 and stats["distill_kl"].dtype == F64
    assert _rel(loss.item(), want.mean()) < 1e-13
