"""model=diffusers_pipeline (models/diffusers_pipeline.py): the pipeline's own loop recorded, the denoiser replayed.

For each pipeline: the velocity the pipeline handed its scheduler equals the replay's (the same weights), the
rollout's log-probs equal the replay's (|ρ − 1| < 1e-5 in float32) with a LoRA that is not zero, and where a
dedicated adapter exists (SD3, Wan) its trajectories and re-scored log-probs equal the generic path's for the same
noise. A pipeline that rescales its guided velocity in no known form is refused with one error line.
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import diffusers
import pytest
import torch
from conftest import SHAPE_PROMPTS
from omegaconf import OmegaConf

from polyrl.actor.local import LocalActor
from polyrl.algorithms.base import AlgorithmBase
from polyrl.algorithms.diffusion_nft import nft_loss
from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.models.diffusers_pipeline import (
    _Recorder,
    cfg_renorm,
    combine,
    fresh_call,
    identify,
    over_white,
    recorded_bytes,
    replay_bytes,
)
from polyrl.sampling import diffusion
from polyrl.sampling.diffusion import RolloutNoise, SamplingPlan, draw_noise, rollout

CPU = torch.device("cpu")
PROMPTS = SHAPE_PROMPTS[:2]


def _generic(path, **options):
    return build_model(OmegaConf.create({"name": "diffusers_pipeline", "path": str(path), "dtype": "float32",
                                         "options": {"max_sequence_length": 16, **options}}), CPU)


def _plan(shape, scale, steps=3, window=(2, (0, 1))):
    return SamplingPlan(num_steps=steps, shape=shape, guidance=Guidance(scale), noise_level=0.7, window_size=window[0],
                        window_range=window[1], batch_size=len(PROMPTS))


def _actor(adapter, plan, targets):
    cfg = SimpleNamespace(lora_rank=4, lora_alpha=4.0, lora_targets=targets, lr=1e-3, betas=(0.9, 0.999),
                          weight_decay=0.0, eps=1e-8, grad_clip=1.0, num_minibatches=1, micro_batch_size=0,
                          ema_decay=0.0)
    algo = AlgorithmBase()
    algo.teacher_path = None
    torch.manual_seed(0)
    actor = LocalActor(adapter, cfg, plan, algo)
    gen = torch.Generator().manual_seed(1)  # a LoRA that changes the output (B is zero at init)
    for name, p in sorted((n, p) for n, p in zip(actor.param_names, actor.params, strict=True)):
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    return actor


def _rollout_capturing(adapter, plan, noise, monkeypatch):
    """A rollout, and the velocity the pipeline handed its scheduler at each step: (B, ...) per step."""
    seen = []
    step = diffusion.Walk.step

    def capture(self, j, v):
        seen.append(v["latents"].clone())
        return step(self, j, v)

    monkeypatch.setattr(diffusion.Walk, "step", capture)
    batch = rollout(adapter, PROMPTS, [{}] * len(PROMPTS), torch.arange(len(PROMPTS)), plan, noise)
    monkeypatch.setattr(diffusion.Walk, "step", step)
    return batch, seen


def _check_replay(adapter, actor, batch, seen):
    """Replayed velocity = the pipeline's at every trained step; rollout log-probs = the replay's."""
    grid = adapter.sigmas(len(seen), actor.plan.shape)
    starts = [int((grid == s).nonzero()) for s in batch.sigmas[:, 0]]  # each sample's window start
    for k in range(batch.log_probs.shape[1]):
        with torch.no_grad():
            v = actor.velocity(batch, {"latents": batch.latents["latents"][:, k]}, batch.sigmas[:, k])["latents"]
        expected = torch.stack([seen[int(s) + k][i] for i, s in enumerate(starts)])
        assert (v - expected).norm() <= 1e-5 * expected.norm(), k
        out = actor.step(batch, k)
        ratio = (out.log_prob.detach() - batch.log_probs[:, k]).exp()
        assert (ratio - 1).abs().max() < 1e-5, (k, ratio)


def _check_live(actor, batch):
    """The replay runs the live weights: its gradient reaches the LoRA and its log-prob moves with the weights."""
    actor.optimizer.zero_grad()
    actor.step(batch, 0).log_prob.sum().backward()
    assert sum(float(p.grad.abs().sum()) for p in actor.params if p.grad is not None) > 0
    with torch.no_grad():
        for p in actor.params:
            p.add_(0.05 * torch.ones_like(p))
        moved = actor.step(batch, 0).log_prob
    assert (moved - batch.log_probs[:, 0]).abs().max() > 1e-6  # the exact replay agrees to ~1e-7


def _check_fresh_sigma(gen_actor, ded_actor, batch, ref):
    """At σ the rollout did not step through (a likelihood-free algorithm's forward process, on fresh x_t): the
    generic velocity equals the dedicated adapter's under the rollout's guidance (AWM) and guidance 1 (the conditional
    branch: DiffusionNFT, DGPO, Diffusion-DPO), and DiffusionNFT's loss and LoRA gradient on the same x_t, t and
    batch agree to float32 rounding (measured: equal losses, gradients within 4e-7 relative)."""
    x0 = batch.final["latents"]
    t = torch.tensor([0.3, 0.81])  # on no rollout grid
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    x_t = (1 - t.view(-1, *[1] * (x0.dim() - 1))) * x0 + t.view(-1, *[1] * (x0.dim() - 1)) * eps
    advantages = torch.tensor([1.5, -0.5])
    results = []
    for actor, b, key in ((gen_actor, batch, "latents"), (ded_actor, ref, "x")):
        with torch.no_grad():
            guided = actor.velocity(b, {key: x_t}, t)[key]
        actor.optimizer.zero_grad()
        v = actor.velocity(b, {key: x_t}, t, guidance=1.0)[key]
        loss = nft_loss(v, v.detach(), x_t, x0, t, advantages, 5.0, 0.1)[0].mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in zip(actor.param_names, actor.params, strict=True) if p.grad is not None}
        results.append((guided, v.detach(), float(loss.detach()), grads))
    (g_guided, g_v, g_loss, g_grads), (d_guided, d_v, d_loss, d_grads) = results
    assert (g_guided - d_guided).abs().max() < 1e-5 * d_guided.abs().max()
    assert (g_v - d_v).abs().max() < 1e-5 * d_v.abs().max()
    assert abs(g_loss - d_loss) < 1e-5 * abs(d_loss)
    assert g_grads.keys() == d_grads.keys() and g_grads
    flat_g = torch.cat([g_grads[n].flatten() for n in sorted(g_grads)])
    flat_d = torch.cat([d_grads[n].flatten() for n in sorted(d_grads)])
    grad_diff = float((flat_g - flat_d).norm() / flat_d.norm())
    assert flat_d.norm() > 0 and grad_diff < 1e-5


# ------------------------------------------------------------------------------------------------ pure pieces
def test_identify_finds_the_form_and_names_what_it_saw():
    g = torch.Generator().manual_seed(0)
    u, c = torch.randn(2, 3, 8, generator=g, dtype=torch.float64), torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    # independent float64 references of each form
    assert identify([c], c.clone(), [4.0])[0][0] == "identity"
    assert identify([u, c], u + 4.0 * (c - u), [4.0])[0][:3] == ("cfg", (0, 1), 4.0)
    assert identify([c, u], u + 4.0 * (c - u), [4.0])[0][:3] == ("cfg", (1, 0), 4.0)
    g_ = u + 4.0 * (c - u)
    renorm = g_ * c.norm(dim=-1, keepdim=True) / g_.norm(dim=-1, keepdim=True)
    assert identify([u, c], renorm, [4.0])[0][:3] == ("cfg_renorm", (0, 1), 4.0)
    assert torch.allclose(cfg_renorm(u, c, 4.0), renorm)
    form, seen = identify([u, c], 0.7 * (u + 4.0 * (c - u)), [4.0])
    assert form is None and "closest known form" in seen
    assert identify([u, c, c], c, [4.0]) == (None, "3 output branches of B rows (known forms take 1 or 2)")
    # guidance 1 on a CFG form: the conditional branch (the actor's guidance-free velocity)
    assert torch.equal(combine(("cfg", (0, 1), 4.0, 1.0), [u, c], guidance=1.0), c)
    # outputs that keep text tokens before the latent positions (Qwen-Image 2.1): the velocity is their tail
    text = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    form, _ = identify([torch.cat([text, c], 1), torch.cat([text[:, :2], u], 1)], c + 3.0 * (c - u), [3.0, 4.0])
    assert form == ("cfg", (1, 0), 4.0, 1.0, ("tail", 3))
    assert identify([torch.cat([c, text], 1)], c, [1.0])[0][4] == ("head", 3)
    assert identify([text[:, :2]], c, [1.0]) == (None, "denoiser outputs of shape (2, 2, 8) per branch vs. a "
                                                       "velocity of shape (2, 3, 8)")
    form, seen = identify([torch.cat([text, c], 1)], 2 * c, [1.0])
    assert form is None and ("head 3 positions" in seen or "tail 3 positions" in seen)


def _records(sigmas, **arguments):
    """One sample's records of a one-call, no-CFG step at each σ: `arguments` name -> a function of (step, σ) giving
    its recorded row (a tensor) or the spec node ("latent")."""
    steps = []
    for j, sigma in enumerate(sigmas):
        slots, kwargs = [], {}
        for name, value in arguments.items():
            value = value(j, sigma)
            if isinstance(value, torch.Tensor):
                slots.append(value[None])
                kwargs[name] = ("rows", len(slots) - 1, 1)
            else:
                kwargs[name] = value
        spec = ((("transformer", ("tuple", []), ("dict", kwargs)),), ("identity", (0,), 1.0, 1.0, None))
        steps.append({"sigma": sigma, "key": "k", "spec": spec, "slots": slots})
    return steps


def test_a_fresh_sigma_identifies_the_timestep_or_names_what_it_could_not():
    latent = lambda j, s: ("latent", torch.float32, 1)  # noqa: E731
    t1000 = lambda j, s: torch.tensor(s, dtype=torch.float32) * 1000  # noqa: E731  (SD3, Wan: the scheduler's)
    mask = lambda j, s: torch.ones(4)  # noqa: E731  (equal to σ at σ = 1)
    embeds = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    fixed = lambda j, s: embeds  # noqa: E731
    sigmas = [1.0, float(torch.tensor(0.7511211))]
    fresh = fresh_call("P", _records(sigmas, hidden_states=latent, timestep=t1000, mask=mask, embeds=fixed), 1000.0)
    node = fresh["spec"][0][0][2][1]
    assert node["timestep"] == ("time", 0, 1, "T·σ", 1000.0) and node["mask"][0] == node["embeds"][0] == "rows"
    # FLUX / Qwen-Image pass the scheduler's timestep / 1000, which float32 rounds apart from σ at some σ
    per_1000 = lambda j, s: torch.tensor(s, dtype=torch.float32) * 1000 / 1000  # noqa: E731
    fresh = fresh_call("P", _records(sigmas, hidden_states=latent, timestep=per_1000, embeds=fixed), 1000.0)
    assert fresh["spec"][0][0][2][1]["timestep"][3] in ("T·σ/T", "σ")

    def error(sigmas, **arguments):
        return fresh_call("P", _records(sigmas, **arguments), 1000.0)["error"]

    head = "model=diffusers_pipeline: P cannot be evaluated at a σ its rollout did not step through"
    # one recorded step at σ = 1: a mask of ones is as good a timestep as the timestep
    msg = error([1.0], hidden_states=latent, timestep=lambda j, s: torch.tensor([s]), mask=mask)
    assert msg.startswith(head) and "2 arguments of transformer (timestep, mask) equal 1000·σ or σ at every " \
        "recorded step" in msg and msg.endswith("(recorded σ: 1)")
    assert error(sigmas, hidden_states=latent, embeds=fixed).startswith(
        f"{head} (a likelihood-free algorithm's forward process): no argument of transformer equals 1000·σ or σ at "
        "every recorded step, so its timestep is not identified")
    assert "no argument of transformer is the latents" in error(sigmas, timestep=t1000, embeds=fixed)
    drift = lambda j, s: embeds + j  # noqa: E731
    assert "transformer's argument embeds changes from step to step and is neither its latents nor its timestep" in error(
        sigmas, hidden_states=latent, timestep=t1000, embeds=drift)
    two = _records(sigmas, hidden_states=latent, timestep=t1000)
    calls, form = two[1]["spec"]
    two[1]["spec"] = ((("transformer_2", *calls[0][1:]),), form)  # Wan2.2 A14B: the low-noise expert
    assert "its steps call different denoisers (transformer at σ=1, transformer_2 at σ=0.7511)" in fresh_call(
        "P", two, 1000.0)["error"]


def test_rgba_is_composited_over_white():
    rgba = torch.rand(2, 4, 3, 3, dtype=torch.float64)
    expected = rgba[:, :3] * rgba[:, 3:] + (1 - rgba[:, 3:])  # float64: alpha blend onto 1.0
    assert torch.allclose(over_white(rgba), expected)
    assert torch.equal(over_white(rgba[:, :3]), rgba[:, :3])


# ------------------------------------------------------------------------------------------------ SD3
@pytest.mark.parametrize("scale", [1.0, 4.5])
def test_sd3_generic_equals_the_dedicated_adapter_and_replays_exactly(tiny_sd3_dir, scale, monkeypatch):
    shape = MediaShape(32, 32)
    plan = _plan(shape, scale)
    gen = _generic(tiny_sd3_dir)
    ded = build_model(OmegaConf.create({"name": "sd3", "path": str(tiny_sd3_dir), "dtype": "float32",
                                        "max_sequence_length": 16}), CPU)
    assert gen.latent_shapes(shape)["latents"] == ded.latent_shapes(shape)["x"]
    assert torch.equal(gen.sigmas(3, shape), ded.sigmas(3, shape))
    targets = gen.default_lora_targets
    assert {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out"} <= set(targets)
    gen_actor, ded_actor = _actor(gen, plan, targets), _actor(ded, plan, targets)
    noise = draw_noise(gen.latent_shapes(shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    batch, seen = _rollout_capturing(gen, plan, noise, monkeypatch)
    forms = {rec["spec"][1][0] for steps in batch.extras["replay"] for rec in steps}
    assert forms == ({"identity"} if scale == 1.0 else {"cfg"})
    _check_replay(gen, gen_actor, batch, seen)
    # the dedicated adapter, same noise and the same LoRA: same trajectories, same re-scored log-probs
    renamed = RolloutNoise({"x": noise.initial["latents"]}, noise.starts, {"x": noise.steps["latents"]})
    ref = rollout(ded, PROMPTS, [{}] * 2, torch.arange(2), plan, renamed)
    assert (batch.latents["latents"] - ref.latents["x"]).abs().max() < 1e-5
    assert (batch.old_means["latents"] - ref.old_means["x"]).abs().max() < 1e-5
    assert (batch.media["images"] - ref.media["images"]).abs().max() < 1e-4
    for k in range(2):
        a, b = gen_actor.step(batch, k).log_prob, ded_actor.step(ref, k).log_prob
        assert (a - b).abs().max() < 1e-5 * b.abs().max()
    _check_fresh_sigma(gen_actor, ded_actor, batch, ref)
    _check_live(gen_actor, batch)
    # memory, measured = computed from the shapes: the latents are not stored (taken from the batch), the prompt's
    # embeddings (CLIP + T5 tokens, max_sequence_length 16, joint width 64) and pooled projection (64) once per
    # sample, the timestep once per recorded step; float32, one row per CFG branch
    rows = 1 if scale == 1.0 else 2
    expected = replay_bytes([(rows, (16 + 16, 64), 4), (rows, (64,), 4)], [(rows, (), 4)], window=2)
    assert recorded_bytes(batch.extras["replay"][:1]) == expected


# ------------------------------------------------------------------------------------------------ Wan
def test_wan_generic_equals_the_dedicated_adapter_and_replays_exactly(tiny_wan_dir, monkeypatch):
    shape = MediaShape(16, 16, 5)
    plan = _plan(shape, 3.0)
    gen = _generic(tiny_wan_dir)
    ded = build_model(OmegaConf.create({"name": "wan", "path": str(tiny_wan_dir), "dtype": "float32",
                                        "max_sequence_length": 16, "shift": None}), CPU)
    # UniPC's grid is replaced by the shifted linear one, as the dedicated adapter does
    assert torch.equal(gen.sigmas(3, shape), ded.sigmas(3, shape))
    targets = gen.default_lora_targets
    gen_actor, ded_actor = _actor(gen, plan, targets), _actor(ded, plan, targets)
    noise = draw_noise(gen.latent_shapes(shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    batch, seen = _rollout_capturing(gen, plan, noise, monkeypatch)
    assert {rec["spec"][1][:2] for steps in batch.extras["replay"] for rec in steps} == {("cfg", (1, 0))}  # two calls
    _check_replay(gen, gen_actor, batch, seen)
    renamed = RolloutNoise({"x": noise.initial["latents"]}, noise.starts, {"x": noise.steps["latents"]})
    ref = rollout(ded, PROMPTS, [{}] * 2, torch.arange(2), plan, renamed)
    assert (batch.latents["latents"] - ref.latents["x"]).abs().max() < 1e-5
    assert batch.media["video"].shape == ref.media["video"].shape == (2, 5, 3, 16, 16)
    for k in range(2):
        a, b = gen_actor.step(batch, k).log_prob, ded_actor.step(ref, k).log_prob
        assert (a - b).abs().max() < 1e-5 * b.abs().max()
    _check_fresh_sigma(gen_actor, ded_actor, batch, ref)


# ------------------------------------------------------------------------------------------------ refusal
class RescaledSD3Pipeline(diffusers.StableDiffusion3Pipeline):
    """SD3 whose guided velocity is rescaled before the scheduler step (0.7·v + 0.3·std(v)): no known form."""

    def __call__(self, *args, **kwargs):
        inner = self.scheduler

        class Rescale:
            def __getattr__(self, name):
                return getattr(inner, name)

            def step(self, v, t, x, **kw):
                return inner.step(0.7 * v + 0.3 * v.std(), t, x, **kw)

        self.__dict__["scheduler"] = Rescale()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self.__dict__["scheduler"] = inner

    __call__.__signature__ = inspect.signature(diffusers.StableDiffusion3Pipeline.__call__)


def test_an_unknown_guidance_rescale_is_refused(tiny_sd3_dir, monkeypatch):
    monkeypatch.setattr(diffusers, "RescaledSD3Pipeline", RescaledSD3Pipeline, raising=False)
    shape = MediaShape(32, 32)
    plan = _plan(shape, 4.5)
    gen = _generic(tiny_sd3_dir, pipeline="RescaledSD3Pipeline")
    noise = draw_noise(gen.latent_shapes(shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    with pytest.raises(UserError, match=r"RescaledSD3Pipeline combines its denoiser outputs in no known form at "
                                        r"step 0: 1 call\(s\) of \[4\] rows, 2 output branch\(es\); the closest"):
        rollout(gen, PROMPTS, [{}] * 2, torch.arange(2), plan, noise)


def test_samples_of_one_prompt_share_their_recorded_rows(tiny_sd3_dir):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, 4, generator=g)  # (CFG blocks, samples, ...): samples 0 and 2 equal
    rows[:, 2] = rows[:, 0]
    kept = _Recorder._unique_rows(rows)
    assert kept[0] is kept[2] and kept[1] is not kept[0] and all(torch.equal(kept[i], rows[:, i]) for i in range(3))
    # a rollout of one prompt twice holds one copy of the conditioning and of each timestep
    gen = _generic(tiny_sd3_dir)
    plan = _plan(MediaShape(32, 32), 4.5)
    noise = draw_noise(gen.latent_shapes(plan.shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    batch = rollout(gen, [PROMPTS[0]] * 2, [{}] * 2, torch.arange(2), plan, noise)
    one = recorded_bytes(batch.extras["replay"][:1])
    assert one == replay_bytes([(2, (16 + 16, 64), 4), (2, (64,), 4)], [(2, (), 4)], window=2)
    assert recorded_bytes(batch.extras["replay"]) == one


def test_a_decode_that_fails_on_the_batch_names_decode_batch(tiny_sd3_dir, monkeypatch):
    """A VAE that cannot decode B > 1 (diffusers 0.42.1's HunyuanVideo-1.5) gets one error line naming the option, and
    decodes with it one sample at a time."""
    gen = _generic(tiny_sd3_dir)
    plan = _plan(MediaShape(32, 32), 1.0)
    noise = draw_noise(gen.latent_shapes(plan.shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    decode = type(gen.pipe.vae).decode

    def one_at_a_time(vae, z, *args, **kwargs):
        if z.shape[0] > 1:
            raise RuntimeError("output with shape [2, 1, 4, 4] doesn't match the broadcast shape [2, 2, 4, 4]")
        return decode(vae, z, *args, **kwargs)

    monkeypatch.setattr(type(gen.pipe.vae), "decode", one_at_a_time)
    with pytest.raises(UserError, match=r"StableDiffusion3Pipeline failed to decode a batch of 2 after its last step "
                                        r"\(output with shape .*\); model.options.decode_batch=1 decodes one sample"):
        rollout(gen, PROMPTS, [{}] * 2, torch.arange(2), plan, noise)
    gen.opts["decode_batch"] = 1
    batch = rollout(gen, PROMPTS, [{}] * 2, torch.arange(2), plan, noise)
    assert batch.media["images"].shape == (2, 3, 32, 32)


def test_a_velocity_without_recorded_calls_is_refused(tiny_sd3_dir):
    gen = _generic(tiny_sd3_dir)
    x = {"latents": torch.zeros(1, 4, 16, 16)}
    with pytest.raises(UserError, match="only by replaying the calls its rollout recorded"):
        gen.velocity(x, torch.ones(1), {}, {}, 1.0)
    with pytest.raises(UserError, match=r"sample 0 recorded no denoiser call \(σ=0.5 asked\)"):
        gen.velocity(x, torch.full((1,), 0.5), {"replay": [[]]}, {}, 1.0)


# ------------------------------------------------------------------------------------------------ the CLI
def test_two_steps_through_the_cli(tiny_sd3_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    # Flow-GRPO (recipe=toy_flow_grpo): the generic pipeline re-scores only the steps its rollout recorded, so it cannot
    # train the default recipe's DiffusionNFT (a forward-process loss at random σ; docs/image_models.md, Limits)
    args = ["train", "recipe=toy_flow_grpo", "model=diffusers_pipeline", f"model.path={tiny_sd3_dir}",
            "model.options.max_sequence_length=16",
            f"data.path={shape_prompts_file}", f"data.heldout_path={shape_prompts_file}", f"trainer.output_dir={out}",
            "trainer.max_steps=2", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", "rollout.guidance_scale=2.0", "trainer.eval_samples=2",
            "trainer.num_validation=2", "trainer.progress=false", "trainer.tensorboard=false",
            "reward=jpeg_compressibility", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
            "trainer.eval_every=2", "trainer.save_every=0"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["grad_norm"] > 0 and "reward/mean" in rows[2]
    assert (out / "samples" / "step_000000.png").is_file() and (out / "samples" / "step_000002.png").is_file()


# ------------------------------------------------------------------------------------------------ other families
def _tiny_chroma(path, words):
    """ChromaPipeline: FLUX-like packed latents, a T5 encoder only, CFG by two calls (cond first)."""
    from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from polyrl.models.tiny import FLUX_DEV_SCHEDULER, word_tokenizer

    torch.manual_seed(0)
    tok = word_tokenizer(words, 16, add_bos=False)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 decoder_start_token_id=tok.pad_token_id)).eval()
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, scaling_factor=0.36, shift_factor=0.12,
                        use_quant_conv=False, use_post_quant_conv=False)
    ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER), vae=vae, text_encoder=t5,
                   tokenizer=tok, transformer=transformer).save_pretrained(str(path))


def _tiny_sana(path, words):
    """SanaPipeline as published: DPM-Solver++ on flow sigmas (replaced by the linear grid), Gemma2, DC-AE; CFG in
    one batched call (uncond first), computed in float32."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from polyrl.models.tiny import word_tokenizer

    torch.manual_seed(0)
    tok = word_tokenizer(words, 512, add_bos=True)
    text = Gemma2Model(Gemma2Config(
        head_dim=16, hidden_size=8, intermediate_size=64, max_position_embeddings=1024, num_attention_heads=2,
        num_hidden_layers=1, num_key_value_heads=2, vocab_size=len(tok), attn_implementation="eager",
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    transformer = SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        sample_size=32)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407)
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                            algorithm_type="dpmsolver++", solver_order=2)
    SanaPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer,
                 scheduler=scheduler).save_pretrained(str(path))


def _tiny_qwen_image(path, words):
    from polyrl.models.tiny import TinyQwenImageSpec, save_tiny_qwen_image

    save_tiny_qwen_image(TinyQwenImageSpec(words=words, image_size=32), path)


def _tiny_flux(path, words):
    from polyrl.models.tiny import TinyFluxSpec, save_tiny_flux

    save_tiny_flux(TinyFluxSpec(words=words), path)


def _tiny_qwen_image21(path, words):
    """QwenImage21Pipeline: Qwen3-VL text encoder, unpatched latents, true CFG without rescale (two calls, cond
    first), an RGBA VAE; `use_kv_cache` off."""
    from polyrl.models.tiny import save_tiny_qwen_image21

    save_tiny_qwen_image21(words, path)


def _tiny_hunyuan_video15(path, words):
    """HunyuanVideo15Pipeline (t2v): Qwen2.5-VL + ByT5 encoders, a diffusers CFG guider (two calls, cond first),
    the latents concatenated with condition latents and a mask along the channels."""
    from polyrl.models.tiny import save_tiny_hunyuan_video15

    save_tiny_hunyuan_video15(words, path)


# family: (builder, guidance scale, the form the rollout must identify, media shape, model.options)
FAMILIES = {
    "qwen_image": (_tiny_qwen_image, 4.0, ("cfg_renorm", (1, 0)), MediaShape(32, 32), {}),  # true CFG, renorm
    "flux": (_tiny_flux, 1.0, ("identity", (0,)), MediaShape(32, 32), {}),  # guidance embedding, packed latents
    "chroma": (_tiny_chroma, 3.0, ("cfg", (1, 0)), MediaShape(32, 32), {}),
    "sana": (_tiny_sana, 4.0, ("cfg", (0, 1)), MediaShape(32, 32), {}),
    "qwen_image21": (_tiny_qwen_image21, 3.0, ("cfg", (1, 0)), MediaShape(32, 32), {}),
    # diffusers 0.42.1's HunyuanVideo-1.5 VAE breaks on a batch > 1 (its causal attention mask): decode one at a time
    "hunyuan_video15": (_tiny_hunyuan_video15, 3.0, ("cfg", (1, 0)), MediaShape(16, 16, 5), {"decode_batch": 1}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_pipelines_replay_exactly(family, tmp_path, monkeypatch):
    build, scale, form, shape, options = FAMILIES[family]
    build(tmp_path / family, sorted({w for p in PROMPTS for w in p.split()}))
    # video: 2 steps, 1 trained (the tiny HunyuanVideo-1.5 attends over ~2000 text and image-slot tokens per call)
    plan = _plan(shape, scale, steps=2, window=(1, (0, 1))) if shape.is_video else _plan(shape, scale)
    gen = _generic(tmp_path / family, **options)
    actor = _actor(gen, plan, None)
    noise = draw_noise(gen.latent_shapes(shape), plan, torch.arange(2), torch.Generator().manual_seed(3))
    batch, seen = _rollout_capturing(gen, plan, noise, monkeypatch)
    assert {rec["spec"][1][:2] for steps in batch.extras["replay"] for rec in steps} == {form}
    if family == "hunyuan_video15":  # its input is [latents, condition latents, mask]: only the latter two stored
        assert "latent_cat" in repr(batch.extras["replay"][0][0]["spec"][0])
        # per sample, float32: per CFG branch the Qwen2.5-VL tokens (1000 × 16) and mask; once the ByT5 tokens
        # (256 × 32) and mask (zeros in both branches when the prompt quotes no text: equal values, stored once), the
        # 729 zero image-slot tokens (× 12) and the condition latents + mask (5 channels × 3 × 4 × 4, the same values
        # at every step); per recorded step the timestep (one tensor for both calls)
        once = [(2, (1000, 16), 4), (2, (1000,), 4), (1, (256, 32), 4), (1, (256,), 4), (1, (729, 12), 4),
                (1, (5, 3, 4, 4), 4)]
        assert recorded_bytes(batch.extras["replay"][:1]) == replay_bytes(once, [(1, (), 4)], window=1)
    if shape.is_video:
        assert batch.media["video"].shape == (2, shape.frames, 3, shape.height, shape.width)
    else:
        assert batch.media["images"].shape == (2, 3, shape.height, shape.width)
    _check_replay(gen, actor, batch, seen)
    if not shape.is_video:  # (the gradient check costs the video family ~8 s; the image families prove it)
        _check_live(actor, batch)


def _tiny_sd3(path, words):
    from polyrl.models.tiny import TinySD3Spec, save_tiny_sd3

    save_tiny_sd3(TinySD3Spec(words=words, image_size=32), path)


def _tiny_wan(path, words):
    from polyrl.models.tiny import TinyWanSpec, save_tiny_wan

    save_tiny_wan(TinyWanSpec(words=words, layout="wan2.1"), path)


# the CLI runs every family: those with a dedicated adapter too (their equality tests build theirs from fixtures)
CLI_FAMILIES = {**FAMILIES, "sd3": (_tiny_sd3, 4.5, ("cfg", (0, 1)), MediaShape(32, 32), {}),
                "wan": (_tiny_wan, 3.0, ("cfg", (1, 0)), MediaShape(16, 16, 5), {})}


@pytest.mark.parametrize("family, recipe", [
    # the default recipe's DiffusionNFT (an ODE rollout; velocities at σ of its own) on every family
    *[(f, "toy_shapes") for f in sorted(CLI_FAMILIES)],
    # the other likelihood-free algorithms on one family: AWM (the rollout's CFG at its own σ), DGPO, Diffusion-DPO
    # (best / worst pairs: the records selected and concatenated with the batch)
    *[("sd3", r) for r in ("toy_awm", "toy_dgpo", "toy_diffusion_dpo")],
    # Flow-GRPO on the image families without a dedicated adapter (HunyuanVideo-1.5's replay is proven exact by
    # test_other_pipelines_replay_exactly; its CLI run, ~10 s, is the DiffusionNFT one)
    *[(f, "toy_flow_grpo") for f in ("chroma", "qwen_image21", "sana")],
])
def test_two_steps_of_other_pipelines_through_the_cli(family, recipe, shape_prompts_file, tmp_path):
    """2 training steps through the CLI: DiffusionNFT (the default recipe's: velocities at σ the rollout did not step
    through, the conditional branch of a CFG rollout) on every family, AWM, DGPO and Diffusion-DPO on SD3, Flow-GRPO
    on the image families without a dedicated adapter: metrics of every step, a gradient, the held-out samples (Qwen-Image 2.1's RGBA decoded over
    white; HunyuanVideo-1.5 as a video)."""
    from PIL import Image

    build, scale, _, shape, options = CLI_FAMILIES[family]
    build(tmp_path / family, sorted({w for p in SHAPE_PROMPTS for w in p.split()}))
    out = tmp_path / "run"
    # Flow-GRPO trains one SDE step; the others record 2 steps (the timestep is identified across them)
    window = ["rollout.sde_window_size=1"] if recipe == "toy_flow_grpo" else ["rollout.sde_window_size=2",
                                                                               "algorithm.num_timesteps=1"]
    args = ["train", f"recipe={recipe}", "model=diffusers_pipeline", f"model.path={tmp_path / family}",
            f"data.path={shape_prompts_file}",
            f"data.heldout_path={shape_prompts_file}", f"trainer.output_dir={out}", "trainer.max_steps=2",
            f"rollout.height={shape.height}", f"rollout.width={shape.width}", "rollout.num_steps=2", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", f"rollout.guidance_scale={scale}",
            "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.progress=false", "trainer.tensorboard=false",
            "reward=jpeg_compressibility", *window, "rollout.sde_window_range=[0,0]",
            "trainer.eval_every=2", "trainer.save_every=0", "actor.lora_rank=4",
            *([f"rollout.num_frames={shape.frames}"] if shape.is_video else []),
            *[f"++model.options.{k}={v}" for k, v in options.items()]]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["grad_norm"] > 0 and "reward/mean" in rows[2]
    if shape.is_video:
        assert (out / "samples" / "step_000002.mp4").stat().st_size > 0
    else:
        with Image.open(out / "samples" / "step_000002.png") as image:
            assert image.mode == "RGB"
