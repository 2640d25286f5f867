"""DiffusionNFT as its authors train it (NVlabs/DiffusionNFT at 24af5554; docs/algorithms.md "DiffusionNFT as its
authors train it"): each option against a float64 transcription of their lines, written here from their
scripts/train_nft_sd3.py, flow_grpo/ema.py and flow_grpo/diffusers_patch/solver.py (the math, in our words):

- `algorithm.time_sampling=grid`: the loss of a micro-batch over its int(0.99·N) grid timesteps per sample;
- `algorithm.decay_clock=optimizer_step`: the old policy's decay `return_decay(global_step)` types 1 and 2;
- `actor.eval_ema_decay`: their `EMAModuleWrapper` (decay min((1+s)/(10+s), 0.9) after optimizer step s);
- `rollout.step=dpm2`: their `dpm2` sampler and diffusers' DPMSolverMultistepScheduler configured as theirs.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from polyrl.actor.local import LocalActor, eval_ema_decay_at
from polyrl.algorithms import build_algorithm
from polyrl.algorithms.diffusion_nft import DiffusionNFT, grid_terms, old_decay
from polyrl.batch import Rollout
from polyrl.draws import UpdateDraws
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.sampling.diffusion import SamplingPlan, draw_noise, sample_latents
from polyrl.sampling.steps import dpm2_step

F64 = torch.float64


def sd3_grid(num_steps: int) -> torch.Tensor:
    """σ_0 = 1 > … > σ_N = 0 of SD3.5's FlowMatchEulerDiscreteScheduler (shift 3), float64."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = FlowMatchEulerDiscreteScheduler(shift=3.0)
    s.set_timesteps(num_steps)
    return s.sigmas.double()


def _batch(x0: torch.Tensor, adv: torch.Tensor, index: torch.Tensor) -> Rollout:
    b = len(x0)
    return Rollout(prompts=["p"] * b, metadata=[{}] * b, group_ids=torch.arange(b), cond={}, shared={},
                   latents={"x": x0[:, None]}, log_probs=torch.zeros(b, 0, dtype=F64),
                   sigmas=torch.zeros(b, 1, dtype=F64), noise_levels=torch.zeros(b, 0, dtype=F64),
                   final={"x": x0}, advantages=adv, sample_index=index)


def _net(x: torch.Tensor, t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A small float64 'velocity network': tanh(x·A) + t·x, per sample over the flattened latent."""
    flat = x.flatten(1)
    return (torch.tanh(flat @ a) + t[:, None] * flat).view_as(x)


class _Policy:
    """A PolicyEvaluator over `_net` with current / old / reference weights and the update's keyed draws."""

    def __init__(self, grid, key, a, a_old, a_ref):
        self.grid, self.draws, self.weights = grid, UpdateDraws(key), {"current": a, "old": a_old, "reference": a_ref}

    def sigma_grid(self):
        return self.grid

    def stream_sigmas(self, t):
        return t

    def velocity(self, batch, x, t, policy="current", guidance=None):
        return {"x": _net(x["x"], t, self.weights[policy])}


def their_grid_loss(x0, adv, timesteps, perm, eps, a, a_old, a_ref, beta, clip, ref_beta, n_train):
    """The loss one micro-batch accumulates in train_nft_sd3.py (gradient accumulation 1): timesteps shuffled per
    sample by `perm` (their perms_time), then for j < n_train: t = timesteps[:, j]/1000, x_t = (1−t)·x0 + t·ε_j,
    r = clamp(clamp(A, ±C)/C/2 + ½, 0, 1), positive / implicit-negative predictions around the old one, x0-space
    errors over their detached float64 mean-absolute weights, (r·pos + (1−r)·neg)/β·C averaged over the batch, plus
    ref_beta·mean((v − v_ref)²); each divided by n_train before its backward."""
    dims = tuple(range(1, x0.ndim))
    shuffled = timesteps[torch.arange(len(x0))[:, None], perm]
    total = 0.0
    for j in range(n_train):
        t = shuffled[:, j] / 1000.0
        te = t.view(-1, *([1] * (x0.ndim - 1)))
        xt = (1 - te) * x0 + te * eps[j]
        old = _net(xt, t, a_old).detach()
        fwd = _net(xt, t, a)
        ref = _net(xt, t, a_ref).detach()
        r = torch.clamp((torch.clamp(adv, -clip, clip) / clip) / 2.0 + 0.5, 0, 1)
        pos_x0 = xt - te * (beta * fwd + (1 - beta) * old)
        neg_x0 = xt - te * ((1.0 + beta) * old - beta * fwd)
        with torch.no_grad():
            w_pos = (pos_x0.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            w_neg = (neg_x0.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        pos = ((pos_x0 - x0) ** 2 / w_pos).mean(dim=dims)
        neg = ((neg_x0 - x0) ** 2 / w_neg).mean(dim=dims)
        policy = ((r * pos / beta + (1.0 - r) * neg / beta) * clip).mean()
        kl = ((fwd - ref) ** 2).mean(dim=dims)
        total = total + (policy + ref_beta * kl.mean()) / n_train
    return total


@pytest.mark.parametrize("num_steps,beta,ref", [(10, 0.1, 1e-4), (25, 1.0, 1e-4)])
def test_grid_draw_loss_and_gradient_equal_the_authors(num_steps, beta, ref):
    """`time_sampling=grid` with fraction 0.99: int(0.99·N) terms (9 of 10, 24 of 25), each sample's own
    permutation of the grid's step σ (σ = 1 included, σ_N = 0 never), and the loss and gradient of their loop."""
    grid = sd3_grid(num_steps)
    algo = build_algorithm({"name": "diffusion_nft", "mix_beta": beta, "ref_coef": ref, "time_sampling": "grid",
                            "grid_fraction": 0.99})
    g = torch.Generator().manual_seed(num_steps)
    b, shape, d = 6, (2, 2, 2), 8
    x0 = torch.randn(b, *shape, generator=g, dtype=F64)
    adv = torch.tensor([-7.0, -1.3, 0.0, 0.4, 2.5, 6.0], dtype=F64)
    a = (0.3 * torch.randn(d, d, generator=g, dtype=F64)).requires_grad_(True)
    a_old = a.detach() + 0.05 * torch.randn(d, d, generator=g, dtype=F64)
    a_ref = a.detach() + 0.05 * torch.randn(d, d, generator=g, dtype=F64)
    index = torch.arange(10, 10 + b)  # the samples' places in a global batch
    batch = _batch(x0, adv, index)
    policy = _Policy(grid, 77, a, a_old, a_ref)
    terms = algo.num_terms_on(batch, policy)
    assert terms == grid_terms(num_steps, 0.99) == {10: 9, 25: 24}[num_steps]
    ours = sum(algo.step_loss(policy, batch, k)[0] for k in range(terms)) / terms
    (grad_ours,) = torch.autograd.grad(ours, a)
    perm = policy.draws.permutation("nft/grid", index, num_steps)
    eps = [policy.draws.normal("nft/eps", index, {"x": shape}, k)["x"].double() for k in range(terms)]
    timesteps = (grid[:-1] * 1000).expand(b, -1)  # their scheduler.timesteps repeated per sample
    theirs = their_grid_loss(x0, adv, timesteps, perm, eps, a, a_old, a_ref, beta, 5.0, ref, terms)
    (grad_theirs,) = torch.autograd.grad(theirs, a)
    assert abs(ours.item() - theirs.item()) <= 1e-14 * abs(theirs.item())
    assert (grad_ours - grad_theirs).abs().max() <= 1e-14 * grad_theirs.abs().max()
    # what each sample trained on: `terms` distinct step sigmas of the grid, σ = 1 among them unless it came last
    trained = torch.stack([algo.train_time(policy, batch, k) for k in range(terms)], 1)
    for row, p in zip(trained, perm, strict=True):
        assert len(set(row.tolist())) == terms and set(row.tolist()) <= set(grid[:-1].tolist())
        assert (1.0 in row.tolist()) == (int(p[-1]) != 0)


def test_flow_factory_discrete_draw_is_one_grid_sigma_per_term():
    """`time_sampling=discrete` (Flow-Factory's NFT recipes): every sample of the update trains term k at the σ its
    TimeSampler.discrete gives for the term's shared draw (forward_process.discrete_sigma, held to Flow-Factory's
    sampler in tests/test_dgpo_awm.py)."""
    from polyrl.algorithms.forward_process import discrete_sigma

    grid = sd3_grid(12).float()
    algo = DiffusionNFT(time_sampling="discrete", num_timesteps=4, timestep_range=(0.0, 0.9))
    policy = _Policy(grid, 9, None, None, None)
    batch = _batch(torch.zeros(5, 1, 2, 2, dtype=F64), torch.zeros(5, dtype=F64), torch.arange(5))
    assert algo.num_terms_on(batch, policy) == 4
    for k in range(4):
        u = policy.draws.shared_uniform("forward_process/sigma", k)
        t = algo.train_time(policy, batch, k)
        assert torch.equal(t, torch.full((5,), discrete_sigma(grid, 0.0, 0.9, k, 4, u), dtype=t.dtype))


def test_grid_draw_is_keyed_by_the_global_sample_not_the_split():
    """Two halves of a batch (two ranks, or two micro-batches) train each sample on the timesteps it gets in one."""
    grid = sd3_grid(10)
    algo = DiffusionNFT(time_sampling="grid")
    x0 = torch.zeros(4, 1, 2, 2, dtype=F64)
    policy = _Policy(grid, 5, None, None, None)
    whole = _batch(x0, torch.zeros(4, dtype=F64), torch.arange(4))
    halves = [_batch(x0[:2], torch.zeros(2, dtype=F64), torch.arange(2)),
              _batch(x0[2:], torch.zeros(2, dtype=F64), torch.arange(2, 4))]
    for k in range(algo.num_terms_on(whole, policy)):
        assert torch.equal(algo.train_time(policy, whole, k),
                           torch.cat([algo.train_time(policy, h, k) for h in halves]))


def return_decay(step: int, decay_type: int) -> float:
    """Their old-policy decay (train_nft_sd3.py): (flat, uprate, uphold) = (0, 0, 0), (0, 0.001, 0.5) or
    (75, 0.0075, 0.999) for types 0, 1, 2; 0 before `flat`, then min((step − flat)·uprate, uphold)."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


NFT_DECAY = {1: {"decay_slope": 0.001, "decay_start": 0, "decay_max": 0.5},
             2: {"decay_slope": 0.0075, "decay_start": 75, "decay_max": 0.999}}


@pytest.mark.parametrize("decay_type", [1, 2])
def test_decay_on_their_clock_and_the_mapping_onto_ours(decay_type):
    """`decay_clock=optimizer_step` with their (flat, uprate, uphold) as (decay_start, decay_slope, decay_max) is
    `return_decay(optimizer steps so far)`; on our update clock, decay = uprate·(S − flat), decay_slope = S·uprate,
    decay_start = 0, decay_max = uphold is the same after every update u (S optimizer steps per update)."""
    keys = NFT_DECAY[decay_type]
    flat, uprate, uphold = keys["decay_start"], keys["decay_slope"], keys["decay_max"]
    clocked = DiffusionNFT(decay_clock="optimizer_step", **keys)
    assert clocked.old_decay_clock == "optimizer_step"
    for steps_per_update in (1, 2, 3):
        for u in range(0, 700):
            steps = steps_per_update * (u + 1)
            want = return_decay(steps, decay_type)
            assert clocked.old_decay(steps) == pytest.approx(want, abs=1e-15)
            mapped = old_decay(u, uprate * (steps_per_update - flat), steps_per_update * uprate, 0, uphold)
            assert mapped == pytest.approx(want, abs=1e-13)


def their_ema(params_after_steps: list[list[torch.Tensor]], initial: list[torch.Tensor], max_decay: float):
    """flow_grpo/ema.py EMAModuleWrapper: starts as a copy of the weights; after optimizer step s (global_step,
    1 after the first) ema += (1 − min((1 + s)/(10 + s), max_decay))·(θ − ema)."""
    ema = [p.clone() for p in initial]
    for s, params in enumerate(params_after_steps, start=1):
        one_minus = 1 - min((1 + s) / (10 + s), max_decay)
        for e, p in zip(ema, params, strict=True):
            e.add_(one_minus * (p - e))
    return ema


class _StubNFT(DiffusionNFT):
    """DiffusionNFT's declarations and schedules with a cheap loss of the trainable weights (no network call), so
    that an update is many optimizer steps of real AdamW in a few milliseconds."""

    def num_terms_on(self, batch, policy):
        return 1

    def step_loss(self, policy, batch, k):
        w = batch.advantages.to(F64)
        loss = sum((p.flatten()[: len(w)] * w).sum() + 0.1 * (p**2).sum() for p in policy.params) / len(policy.params)
        return loss, {"loss": loss.detach()}


def _nft_actor(model_dir, algo, eval_ema_decay=0.0):
    cfg = OmegaConf.create({"name": "sd3", "path": str(model_dir), "dtype": "float64", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    actor_cfg = SimpleNamespace(lora_rank=2, lora_alpha=2.0, lora_targets=None, lr=1e-2, betas=(0.9, 0.999),
                                weight_decay=1e-4, eps=1e-8, grad_clip=1.0, num_minibatches=2, micro_batch_size=0,
                                ema_decay=0.0, eval_ema_decay=eval_ema_decay)
    plan = SamplingPlan(num_steps=3, shape=MediaShape(32, 32), guidance=Guidance(1.0), noise_level=0.0)
    return LocalActor(adapter, actor_cfg, plan, algo)


def _update_batch(u: int) -> Rollout:
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5], dtype=F64) * (1 + 0.1 * u)
    return _batch(torch.zeros(4, 1, dtype=F64), adv, None)


@pytest.mark.parametrize("decay_type", [1, 2])
def test_actor_moves_the_old_copy_and_the_evaluation_ema_as_theirs(tiny_sd3_dir, tmp_path, decay_type):
    """45 updates of 2 optimizer steps (90 steps: type 2's ramp starts after 75): after every update the old copy is
    theirs (old ← d·old + (1−d)·θ, d = return_decay(global_step)), the evaluation EMA is their EMAModuleWrapper's,
    evaluation swaps it in and back, and a checkpoint resumes both exactly."""
    algo = _StubNFT(decay_clock="optimizer_step", **NFT_DECAY[decay_type])
    actor = _nft_actor(tiny_sd3_dir, algo, eval_ema_decay=0.9)
    initial = [p.detach().clone() for p in actor.params]
    after_steps = []
    actor.optimizer.register_step_post_hook(lambda *_: after_steps.append([p.detach().clone() for p in actor.params]))
    old = [p.clone() for p in initial]
    for u in range(45):
        actor.update(algo, _update_batch(u), torch.Generator().manual_seed(u))
        d = return_decay(len(after_steps), decay_type)
        old = [o * d + p.detach() * (1.0 - d) for o, p in zip(old, actor.params, strict=True)]
        assert max((a - b).abs().max().item() for a, b in zip(actor.old_params, old, strict=True)) <= 1e-14
    assert actor.optimizer_steps == len(after_steps) == 90 and actor.num_updates == 45
    ema = their_ema(after_steps, initial, 0.9)
    assert max((a - b).abs().max().item() for a, b in zip(actor.eval_params, ema, strict=True)) <= 1e-14
    trained = [p.detach().clone() for p in actor.params]
    with actor.evaluation_weights():
        assert all(torch.equal(p, e) for p, e in zip(actor.params, ema, strict=False)) or \
            max((p - e).abs().max().item() for p, e in zip(actor.params, ema, strict=True)) <= 1e-14
    assert all(torch.equal(p, t) for p, t in zip(actor.params, trained, strict=True))
    # a checkpoint: the weights, the old copy, the evaluation EMA and the clocks; then one more update on both
    actor.save_weights(tmp_path)
    resumed = _nft_actor(tiny_sd3_dir, algo, eval_ema_decay=0.9)
    resumed.load_weights(tmp_path)
    resumed.load_optimizer_state(tmp_path, copy.deepcopy(actor.optimizer_state()))  # as trainer_state.pt keeps it
    assert (resumed.optimizer_steps, resumed.num_updates) == (90, 45)
    for a in (actor, resumed):
        a.update(algo, _update_batch(45), torch.Generator().manual_seed(45))
    for mine, theirs in ((actor.params, resumed.params), (actor.old_params, resumed.old_params),
                         (actor.eval_params, resumed.eval_params)):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))


def test_evaluation_ema_decay_warm_up():
    assert [eval_ema_decay_at(s, 0.9) for s in (0, 1, 2, 80, 81, 1000)] == pytest.approx(
        [0.1, 2 / 11, 3 / 12, 81 / 90, 0.9, 0.9])


# ------------------------------------------------------------------------------------------------ DPM-Solver-2
def their_dpm2(v_fn, z, sigmas):
    """Their `run_sampling(..., solver="dpm2", deterministic=True)` (flow_grpo/diffusers_patch/solver.py), float64:
    data prediction x0 = z − σ_i·v; step 0 and the last step the DDIM update with η = 0
    ((1 − t)·x0 + t·(z − (1 − s)·x0)/s, s = σ_i, t = σ_{i+1}); the others the multistep second-order update with
    α = 1 − σ, λ = log α − log σ, h = λ_t − λ_s0, r0 = (λ_s0 − λ_s1)/h, D1 = (m0 − m1)/r0:
    (σ_t/σ_s0)·z − α_t(e^(−h) − 1)·m0 − ½·α_t(e^(−h) − 1)·D1. Returns every state."""
    states, outputs = [z], []
    n = len(sigmas) - 1
    for i in range(n):
        s, t = sigmas[i], sigmas[i + 1]
        x0 = z - s * v_fn(z, s)
        outputs.append(x0)
        if i == 0 or i == n - 1:
            z = (1 - t) * x0 + t * ((z - (1 - s) * x0) / s)
        else:
            s1 = sigmas[i - 1]
            lam = lambda q: torch.log(1 - q) - torch.log(q)  # noqa: E731
            h = lam(t) - lam(s)
            r0 = (lam(s) - lam(s1)) / h
            d1 = (1.0 / r0) * (outputs[-1] - outputs[-2])
            z = (t / s) * z - ((1 - t) * (torch.exp(-h) - 1.0)) * outputs[-1] \
                - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
        states.append(z)
    return states


def diffusers_dpm2(v_fn, z, sigmas, float64: bool):
    """diffusers' DPMSolverMultistepScheduler configured as their solver (dpmsolver++, order 2, midpoint, flow
    prediction on flow sigmas α = 1 − σ, lower-order final, final σ 0) on the same grid. `float64`: its update
    functions driven as its `step` drives them (`step` itself casts the sample to float32)."""
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                       prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                       lower_order_final=True, final_sigmas_type="zero")
    n = len(sigmas) - 1
    sched.set_timesteps(n)
    sched.sigmas = sigmas.clone() if float64 else sigmas.float()
    sched.timesteps = (sigmas[:-1] * 1000).long()
    sched.set_begin_index(0)
    states = [z]
    for i in range(n):
        v = v_fn(z, sigmas[i])
        if not float64:
            z = sched.step(v.float(), sched.timesteps[i], z.float()).prev_sample.double()
        else:
            if sched.step_index is None:
                sched._init_step_index(sched.timesteps[i])
            x0 = sched.convert_model_output(v, sample=z)
            sched.model_outputs = [*sched.model_outputs[1:], x0]
            if sched.lower_order_nums < 1 or sched.step_index == n - 1:
                z = sched.dpm_solver_first_order_update(x0, sample=z)
            else:
                z = sched.multistep_dpm_solver_second_order_update(sched.model_outputs, sample=z)
            sched.lower_order_nums = min(sched.lower_order_nums + 1, 2)
            sched._step_index += 1
        states.append(z)
    return states


def _ours_dpm2(v_fn, z, sigmas):
    states, x0_prev = [z], None
    for i in range(len(sigmas) - 1):
        b = len(z)
        out, x0_prev = dpm2_step(z, v_fn(z, sigmas[i]), sigmas[i].expand(b), sigmas[i + 1].expand(b),
                                 None if i == 0 else sigmas[i - 1].expand(b), x0_prev)
        assert out.std.abs().max() == 0 and out.log_prob.abs().max() == 0
        z = out.sample
        states.append(z)
    return states


@pytest.mark.parametrize("num_steps", [10, 25])
def test_dpm2_equals_their_solver_and_diffusers(num_steps):
    sigmas = sd3_grid(num_steps)
    g = torch.Generator().manual_seed(num_steps)
    w = 0.5 * torch.randn(12, 12, generator=g, dtype=F64)
    c = torch.randn(3, 12, generator=g, dtype=F64)

    def v_fn(z, s):  # a velocity field that depends on the state and the noise level
        flat = z.flatten(1)
        return (torch.tanh(flat @ w) * (1 + float(s)) - c).view_as(z)

    z = torch.randn(3, 3, 2, 2, generator=g, dtype=F64)
    ours = _ours_dpm2(v_fn, z, sigmas)
    for ref in (their_dpm2(v_fn, z, sigmas), diffusers_dpm2(v_fn, z, sigmas, float64=True)):
        scale = max(r.abs().max().item() for r in ref)
        assert max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True)) <= 1e-14 * scale
    # diffusers' own `step` (it computes in float32): the same to float32 rounding
    as_stepped = diffusers_dpm2(v_fn, z, sigmas, float64=False)
    assert (ours[-1] - as_stepped[-1]).abs().max() <= 2e-5 * ours[-1].abs().max()
    # second order where it should be: not the Euler path
    euler = z
    for i in range(num_steps):
        euler = euler + (sigmas[i + 1] - sigmas[i]) * v_fn(euler, sigmas[i])
    assert (euler - ours[-1]).abs().max() > 1e-3


def test_dpm2_rollout_on_a_model_equals_the_reference_solver(tiny_sd3_dir):
    """`rollout.step=dpm2` through the rollout's Walk on the tiny SD3 in float64: the states are their solver's
    with the model's velocity (guidance 1), on the model's own grid."""
    cfg = OmegaConf.create({"name": "sd3", "path": str(tiny_sd3_dir), "dtype": "float64", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    plan = SamplingPlan(num_steps=4, shape=MediaShape(32, 32), guidance=Guidance(1.0), noise_level=0.0, step="dpm2")
    cond = adapter.encode_prompts(["a red circle", "two blue squares"])
    shared = adapter.encode_guidance(plan.guidance)
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = sample_latents(adapter, cond, shared, noise, plan)
        sigmas = adapter.sigmas(4, plan.shape).double()

        def v_fn(z, s):
            return adapter.velocity({"x": z}, torch.full((2,), float(s), dtype=F64), cond, shared, 1.0)["x"].double()

        want = their_dpm2(v_fn, noise.initial["x"].double(), sigmas)
    scale = want[-1].abs().max().item()
    assert (got.final["x"] - want[-1]).abs().max().item() <= 1e-12 * scale
    assert got.log_probs.abs().max() == 0 and got.noise_levels.abs().max() == 0
    assert not math.isnan(float(got.final["x"].sum()))


def test_config_takes_the_options_and_refuses_what_does_not_fit():
    from polyrl.config import ConfigError, load_config

    cfg = load_config(["algorithm=diffusion_nft", "algorithm.time_sampling=grid", "algorithm.grid_fraction=0.99",
                       "algorithm.decay_clock=optimizer_step", "rollout.step=dpm2", "rollout.noise_level=0",
                       "actor.eval_ema_decay=0.9"])
    assert cfg.rollout.step == "dpm2" and cfg.actor.eval_ema_decay == 0.9
    with pytest.raises(ConfigError, match="rollout.step=dpm2 is a deterministic ODE solver .* flow_grpo scores"):
        load_config(["recipe=toy_flow_grpo", "rollout.step=dpm2"])
    with pytest.raises(ConfigError, match="rollout.noise_level=0.7 must be 0"):
        load_config(["algorithm=diffusion_nft", "rollout.step=dpm2", "rollout.noise_level=0.7"])
    with pytest.raises(ConfigError, match="actor.eval_ema_decay=1.0 must be in"):
        load_config(["actor.eval_ema_decay=1.0"])
    for key, value, allowed in (("time_sampling", "logit_normal", "uniform, grid, discrete, discrete_wo_init"),
                                ("decay_clock", "epoch", "update, optimizer_step")):
        with pytest.raises(ConfigError, match=f"algorithm.{key}='{value}'; allowed: {allowed}"):
            load_config([f"algorithm.{key}={value}"])
    with pytest.raises(ConfigError, match="algorithm.grid_fraction=0.0 must be in"):
        load_config(["algorithm.grid_fraction=0.0"])
    assert np.isclose(grid_terms(10, 0.99), 9)


def test_held_out_evaluation_samples_under_the_evaluation_weights(monkeypatch):
    """The trainer's evaluation runs inside `actor.evaluation_weights()` (the evaluation EMA when kept)."""
    from contextlib import contextmanager

    from polyrl.trainer import loop

    inside = []

    class Actor:
        active = False

        @contextmanager
        def evaluation_weights(self):
            self.active = True
            yield
            self.active = False

    actor = Actor()
    monkeypatch.setattr(loop, "evaluate", lambda *a: inside.append(actor.active) or (0.5, None))
    fake = SimpleNamespace(actor=actor, sampler=None, reward=None, data=SimpleNamespace(heldout=[{}], source=None),
                           cfg=OmegaConf.create({"reward": {"name": "r"}, "trainer": {"eval_samples": 2, "eval_seed": 0}}))
    assert loop.Trainer.evaluate(fake) == (0.5, None) and inside == [True] and not actor.active
