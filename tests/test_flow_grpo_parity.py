"""flow_grpo's conventions, selectable by config (docs/algorithms.md §3 "Conventions that change training"), each against
an independent float64 computation written the way flow_grpo writes it:
(a) `algorithm.kl_form=flow_grpo`: the KL divided by 2·std_dev_t², the std flow_grpo's step function returns (`sde`:
    without √(−dt); `cps`: the whole transition std);
(b) `rollout.log_density=squared_distance`: a step scored with −mean_d (x' − μ)²;
(c) `algorithm.drop_zero_advantage=true`: samples whose advantage is 0 are not trained on."""

import json
import math

import pytest
import torch

from polyrl.algorithms import build_algorithm
from polyrl.algorithms.flow_grpo import kl_to_reference
from polyrl.batch import Rollout
from polyrl.cli.main import main
from polyrl.sampling.steps import STEPS, sde_std, step_latents

f64 = torch.float64


def _sde_inputs(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    x, v = torch.randn(b, 4, 5, 5, generator=g, dtype=f64), torch.randn(b, 4, 5, 5, generator=g, dtype=f64)
    sigma = torch.tensor([1.0, 0.8, 0.5], dtype=f64)[:b]
    sigma_next = torch.tensor([0.9, 0.6, 0.3], dtype=f64)[:b]
    return x, v, sigma, sigma_next, g


def test_flow_grpo_kl_form_divides_by_the_std_without_sqrt_dt():
    x, v, sigma, sigma_next, g = _sde_inputs()
    a, sigma_1 = 0.7, 0.9
    out = STEPS["sde"](x, v, sigma, sigma_next, torch.full((3,), a, dtype=f64), sigma_1)
    ref_mean = out.mean + 0.01 * torch.randn(out.mean.shape, generator=g, dtype=f64)
    # flow_grpo: std_dev_t = sqrt(σ/(1 − (σ == 1 ? σ_max : σ)))·a, kl = mean((μ − μ_ref)²) / (2·std_dev_t²)
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_1), sigma))) * a
    expected = ((out.mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
    dt = sigma_next - sigma
    got = kl_to_reference(out.mean, ref_mean, out.std, dt, "flow_grpo")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    exact = kl_to_reference(out.mean, ref_mean, out.std, dt, "exact")
    torch.testing.assert_close(exact, expected / (-dt), rtol=1e-12, atol=0)  # the exact KL is 1/(−dt) larger
    torch.testing.assert_close(std_dev_t, sde_std(sigma, torch.full((3,), a, dtype=f64), sigma_1))
    with pytest.raises(ValueError, match="algorithm.kl_form='nope'; allowed: exact, flow_grpo"):
        build_algorithm({"name": "flow_grpo", "kl_form": "nope"})


@pytest.mark.parametrize("step", ["cps", "sde"])
def test_squared_distance_log_density(step):
    x, v, sigma, sigma_next, g = _sde_inputs(1)
    level = torch.full((3,), 0.5, dtype=f64)
    noise = {"x": torch.randn(x.shape, generator=g, dtype=f64)}
    sampled = step_latents(STEPS[step], {"x": x}, {"x": v}, sigma, sigma_next, level, 0.9, noise=noise,
                           log_density="squared_distance")
    x_next, mean = sampled.sample["x"], sampled.mean["x"]
    torch.testing.assert_close(sampled.log_prob, -((x_next - mean) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)
    # re-scoring the stored transition (what the actor does) gives the same number; a moved policy scores lower
    rescored = step_latents(STEPS[step], {"x": x}, {"x": v}, sigma, sigma_next, level, 0.9, prev={"x": x_next},
                            log_density="squared_distance")
    torch.testing.assert_close(rescored.log_prob, sampled.log_prob, rtol=0, atol=0)
    moved = step_latents(STEPS[step], {"x": x}, {"x": v + 0.1}, sigma, sigma_next, level, 0.9, prev={"x": x_next},
                         log_density="squared_distance")
    gaussian = step_latents(STEPS[step], {"x": x}, {"x": v + 0.1}, sigma, sigma_next, level, 0.9, prev={"x": x_next})
    s2 = sampled.std**2
    # Δ(log p) of the two scores differ by the factor 2s² (the Gaussian's −(x'−μ)²/(2s²) term)
    gaussian_base = step_latents(STEPS[step], {"x": x}, {"x": v}, sigma, sigma_next, level, 0.9, prev={"x": x_next})
    torch.testing.assert_close(moved.log_prob - rescored.log_prob,
                               2 * s2 * (gaussian.log_prob - gaussian_base.log_prob), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="rollout.log_density='nope'"):
        step_latents(STEPS[step], {"x": x}, {"x": v}, sigma, sigma_next, level, 0.9, log_density="nope")


def _batch(advantages):
    b = len(advantages)
    return Rollout(prompts=[f"p{i}" for i in range(b)], metadata=[{}] * b, group_ids=torch.arange(b) // 2,
                   cond={"c": torch.arange(float(b))[:, None]}, shared={}, latents={"x": torch.zeros(b, 2, 1)},
                   log_probs=torch.zeros(b, 1), sigmas=torch.zeros(b, 2), noise_levels=torch.zeros(b, 1),
                   final={"x": torch.zeros(b, 1)}, advantages=torch.tensor(advantages))


def test_drop_zero_advantage_keeps_only_the_samples_with_signal():
    adv = [0.0, 0.0, 1.2, -1.2, 0.0, 0.0, 0.5, -0.5]  # groups 0 and 2 are flat
    kept = build_algorithm({"name": "flow_grpo", "drop_zero_advantage": True}).prepare(_batch(adv))
    assert kept.prompts == ["p2", "p3", "p6", "p7"] and kept.cond["c"].flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    assert len(build_algorithm({"name": "flow_grpo"}).prepare(_batch(adv))) == 8  # the default keeps every sample


def test_flow_grpo_forms_through_the_cli(tiny_sd3_dir, shape_prompts_file, tmp_path):
    """The cps toy recipe with flow_grpo's forms (squared-distance score, its cps KL, flat groups dropped) trains."""
    out = tmp_path / "run"
    args = ["train", "recipe=toy_flow_grpo_cps", f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}",
            "data.heldout_path=null", "reward=jpeg_compressibility", f"trainer.output_dir={out}", "trainer.max_steps=1",
            "trainer.eval_every=0", "trainer.progress=false", "trainer.tensorboard=false", "rollout.height=32",
            "rollout.width=32", "rollout.num_steps=3", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
            "rollout.n=2", "data.prompts_per_step=2", "model.max_sequence_length=16"]
    assert main(args) == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["train/samples"] == 4 and math.isfinite(row["kl"]) and math.isfinite(row["loss"])


def _flow_grpo_step_mean_and_std(step, x, v, sigma, sigma_next, a, sigma_max):
    """flow_grpo's `sde_step_with_logprob` (sde_type 'sde' / 'cps'), written out in float64: (mean, std_dev_t)."""
    sig, nxt, a = (t.view(-1, 1, 1, 1) for t in (sigma, sigma_next, a))
    dt = nxt - sig
    if step == "sde":
        std_dev_t = torch.sqrt(sig / (1 - torch.where(sig == 1, torch.full_like(sig, sigma_max), sig))) * a
        mean = x * (1 + std_dev_t**2 / (2 * sig) * dt) + v * (1 + std_dev_t**2 * (1 - sig) / (2 * sig)) * dt
    else:
        std_dev_t = nxt * torch.sin(a * math.pi / 2)
        mean = (x - sig * v) * (1 - nxt) + (x + v * (1 - sig)) * torch.sqrt(nxt**2 - std_dev_t**2)
    return mean, std_dev_t.flatten()


@pytest.mark.parametrize("step", ["sde", "cps", "dance"])
def test_flow_grpo_kl_form_per_step_type(step):
    """kl_form=flow_grpo is flow_grpo's kl = mean_d (μ − μ_ref)² / (2·std_dev_t²), with std_dev_t what its step
    function returns for that step type: for `cps` the whole transition std (so it equals the exact KL), for `sde`
    the std without √(−dt). `dance` has no flow_grpo step: it is flow_grpo's `sde` with a_i = η·sqrt((1−σ̃)/σ)."""
    from polyrl.algorithms.flow_grpo import add_reference_kl

    g = torch.Generator().manual_seed(3)
    x, v = (torch.randn(4, 3, 4, 4, generator=g, dtype=f64) for _ in range(2))
    v_ref = v + 0.05 * torch.randn(v.shape, generator=g, dtype=f64)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.2], dtype=f64)
    sigma_next = torch.tensor([0.9, 0.6, 0.3, 0.0], dtype=f64)
    sigma_max, level = 0.9, torch.tensor([0.7, 0.5, 0.9, 0.6], dtype=f64)
    out = step_latents(STEPS[step], {"x": x}, {"x": v}, sigma, sigma_next, level, sigma_max,
                       noise={"x": torch.randn(x.shape, generator=g, dtype=f64)})
    assert out.step == step

    class Reference:  # the PolicyEvaluator's reference policy: the same transition under v_ref
        def step(self, batch, k, policy="current"):
            assert policy == "reference"
            return step_latents(STEPS[step], {"x": x}, {"x": v_ref}, sigma, sigma_next, level, sigma_max, prev=out.sample)

    if step == "dance":  # flow_grpo's sde step at a_i = η·sqrt((1−σ̃)/σ), σ̃ = σ_max where σ = 1
        a = level * torch.sqrt((1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)) / sigma)
        fg_step = "sde"
    else:
        a, fg_step = level, step
    mean, std_dev_t = _flow_grpo_step_mean_and_std(fg_step, x, v, sigma, sigma_next, a, sigma_max)
    mean_ref, _ = _flow_grpo_step_mean_and_std(fg_step, x, v_ref, sigma, sigma_next, a, sigma_max)
    torch.testing.assert_close(out.mean["x"], mean, rtol=1e-12, atol=1e-12)  # the same transition as flow_grpo's
    expected = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
    if step == "cps":  # into σ' = 0 the step is deterministic: flow_grpo divides by 0, polyrl reports 0
        assert std_dev_t[3] == 0 and not torch.isfinite(expected[3])
        expected[3] = 0.0

    stats = {}
    loss = add_reference_kl(Reference(), None, 0, out, 1.0, torch.zeros((), dtype=f64), stats, "flow_grpo")
    torch.testing.assert_close(stats["kl"], expected.mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, expected.mean(), rtol=1e-12, atol=0)
    got = kl_to_reference(out.mean, Reference().step(None, 0, "reference").mean, out.std, out.dt, "flow_grpo", step)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    exact = kl_to_reference(out.mean, Reference().step(None, 0, "reference").mean, out.std, out.dt, "exact", step)
    if step == "cps":
        torch.testing.assert_close(got, exact, rtol=0, atol=0)  # flow_grpo's cps KL is the exact Gaussian KL
    else:
        torch.testing.assert_close(got, exact * (sigma - sigma_next), rtol=1e-12, atol=0)  # the exact KL × (−dt)


def test_recipes_with_flow_grpo_kl_form_use_every_flow_grpo_form():
    """A recipe that selects flow_grpo's KL form claims flow_grpo's values, so it takes flow_grpo's other forms too:
    flat groups dropped, and for `cps` steps the squared-distance score."""
    from polyrl.config import CONFIG_DIR, load_config

    claiming = {}
    for path in sorted((CONFIG_DIR / "recipe").glob("*.yaml")):
        if "kl_form: flow_grpo" not in path.read_text():
            continue
        overrides = [f"recipe={path.stem}", "model.path=/x", "data.path=/y.txt"]
        cfg = load_config(overrides + (["reward.path=/z"] if "reward.path" in path.read_text() else []))
        claiming[path.stem] = cfg
        assert cfg.algorithm.kl_form == "flow_grpo"
        assert cfg.algorithm.drop_zero_advantage, path.stem
        assert cfg.rollout.step != "cps" or cfg.rollout.log_density == "squared_distance", path.stem
    assert {"ace_step_flowgrpo", "stable_audio_flowgrpo", "stable_audio_3_flowgrpo", "sd35_flowgrpo",
            "toy_flow_grpo_cps"} <= set(claiming)
    assert claiming["stable_audio_3_flowgrpo"].rollout.step == "cps"
