"""FLUX.2 (Klein base with CFG, step-distilled Klein, dev with its guidance embedding) against diffusers'
Flux2KleinPipeline / Flux2Pipeline on tiny saved pipelines: the text conditioning, the guided denoiser output at every
step of a pipeline run, the sigma grid, decode, the FLOP count against the executed ops, and the recipe through the
CLI.

FLUX.2-dev's tokenizer component is a PixtralProcessor, which cannot be built without torchvision: its reference
pipeline gets the saved tokenizer (the only part its text path uses) instead."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import SHAPE_PROMPTS
from flop_count import count_flops, dispatch_attention
from omegaconf import OmegaConf

from polyrl.cli.main import main
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.models.flux2 import (
    FLUX2_LORA_TARGETS,
    flux2_empirical_mu,
    flux2_forward_flops,
    patchify,
    text_ids,
    token_ids,
    unpatchify,
)
from polyrl.models.tiny import FLUX2_LAYOUTS, TinyFlux2Spec, save_tiny_flux2

WORDS = sorted({w for p in SHAPE_PROMPTS for w in p.split()})
MAX_LEN = 48


LAYOUTS = [*FLUX2_LAYOUTS, "klein-kv"]


@pytest.fixture(scope="module")
def flux2_dirs(tmp_path_factory):
    """layout -> a tiny saved pipeline directory; "klein-kv" is the distilled Klein saved as a Flux2KleinKVPipeline
    (FLUX.2-klein-9b-kv's layout, whose index holds no is_distilled)."""
    import shutil

    dirs = {layout: save_tiny_flux2(TinyFlux2Spec(words=WORDS, layout=layout, text_max_length=MAX_LEN),
                                    tmp_path_factory.mktemp(f"flux2_{layout}"), seed=i)
            for i, layout in enumerate(FLUX2_LAYOUTS)}
    kv = tmp_path_factory.mktemp("flux2_klein_kv") / "ckpt"
    shutil.copytree(dirs["klein-distilled"], kv)
    index = json.loads((kv / "model_index.json").read_text())
    del index["is_distilled"]
    (kv / "model_index.json").write_text(json.dumps({**index, "_class_name": "Flux2KleinKVPipeline"}))
    return {**dirs, "klein-kv": kv}


@pytest.fixture(scope="module")
def adapters(flux2_dirs):
    return {layout: _adapter(path) for layout, path in flux2_dirs.items()}


def _adapter(path, **kw):
    cfg = {"name": "flux2", "path": str(path), "dtype": "float32", "max_sequence_length": MAX_LEN, **kw}
    return build_model(OmegaConf.create(cfg), torch.device("cpu"))


def _pipeline(path, layout):
    from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline, Flux2Pipeline
    from transformers import AutoTokenizer

    if layout == "klein-kv":
        pipe = Flux2KleinKVPipeline.from_pretrained(str(path))
    elif layout == "dev":
        pipe = Flux2Pipeline.from_pretrained(str(path), tokenizer=None)
        pipe.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    else:
        pipe = Flux2KleinPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ----------------------------------------------------------------------------------------------- pure pieces
def test_patchify_ids_and_mu_are_the_pipelines():
    from diffusers import Flux2KleinPipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    z = torch.randn(2, 3, 8, 6)
    assert torch.equal(patchify(z), Flux2KleinPipeline._patchify_latents(z))
    assert torch.equal(unpatchify(patchify(z)), z)
    assert patchify(z)[0, 3 * 4 - 1, 1, 2] == z[0, 2, 3, 5]  # channel c·4 + 2r + s of pixel (i, j): z[c, 2i+r, 2j+s]
    x = patchify(z)
    assert torch.equal(token_ids(4, 3), Flux2KleinPipeline._prepare_latent_ids(x)[0])
    assert torch.equal(text_ids(5), Flux2KleinPipeline._prepare_text_ids(torch.zeros(1, 5, 2))[0])
    # the pipeline's packing is row-major over the latent grid, as the adapter's flatten
    assert torch.equal(Flux2KleinPipeline._pack_latents(x), x.flatten(2).transpose(1, 2))
    for tokens in (64, 256, 1024, 4096, 4300, 4301, 16384):
        for steps in (4, 8, 28, 50):
            assert flux2_empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), rel=1e-12)


def test_sigmas_use_the_empirical_mu(adapters):
    """Exponential shift e^μ/(e^μ + 1/t − 1) of t = linspace(1, 1/N, N), μ from the token count and step count, by
    hand in float64."""
    adapter = adapters["klein"]
    for size, steps in ((32, 4), (64, 8)):
        got = adapter.sigmas(steps, MediaShape(size, size))
        tokens = (size // 4) ** 2  # tiny VAE ÷2, patchify ÷2
        mu = flux2_empirical_mu(tokens, steps)
        t = np.linspace(1.0, 1.0 / steps, steps)
        assert got.dtype == torch.float32 and got.shape == (steps + 1,) and got[-1] == 0
        np.testing.assert_allclose(got[:-1].numpy(), np.exp(mu) / (np.exp(mu) + (1 / t - 1)), atol=2e-7)


# ----------------------------------------------------------------------------------------------- vs the pipelines
@pytest.mark.parametrize("layout", FLUX2_LAYOUTS)
def test_text_conditioning_equals_encode_prompt(layout, adapters, flux2_dirs):
    adapter, pipe = adapters[layout], _pipeline(flux2_dirs[layout], layout)
    prompts = [SHAPE_PROMPTS[0], "", " ".join(WORDS * 4)]  # a long prompt is truncated
    ours = adapter.encode_prompts(prompts)["prompt_embeds"]
    theirs, ids = pipe.encode_prompt(prompts, max_sequence_length=MAX_LEN)
    assert ours.shape == theirs.shape == (3, MAX_LEN, 3 * 16)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert torch.equal(ids[0], text_ids(MAX_LEN))


CASES = {  # layout -> (rollout guidance, pipeline guidance_scale: None for a pipeline without one)
    "klein": (4.0, 4.0),  # CFG with the empty negative prompt
    "klein-distilled": (1.0, 4.0),  # the pipeline ignores its scale for a distilled model
    "dev": (4.0, 4.0),  # the guidance embedding
    "klein-kv": (1.0, None),  # never guides
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_velocity_equals_the_pipeline_denoiser(layout, adapters, flux2_dirs):
    """Run the pipeline (4 steps, 32×48) and record the noise prediction it hands the scheduler at every step: the
    adapter's velocity at the same latents and σ equals it; then every step in one batch, and the decoded image."""
    adapter, pipe = adapters[layout], _pipeline(flux2_dirs[layout], layout)
    scale, pipe_scale = CASES[layout]
    steps, step = [], pipe.scheduler.step

    def recording(model_output, timestep, sample, **kw):
        steps.append((model_output.clone(), timestep.clone(), sample.clone()))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = recording
    prompt, height, width = SHAPE_PROMPTS[1], 32, 48
    final = {}
    kw = {} if pipe_scale is None else {"guidance_scale": pipe_scale}
    out = pipe(prompt=prompt, height=height, width=width, num_inference_steps=4, max_sequence_length=MAX_LEN,
               generator=torch.Generator().manual_seed(0), output_type="pt",
               callback_on_step_end=lambda p, i, t, kw: final.update(kw) or {}, **kw)
    shape = MediaShape(height, width)
    c, h, w = adapter.latent_shapes(shape)["x"]
    assert (c, h, w) == (32, 8, 12)
    sigmas = adapter.sigmas(4, shape)
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and len(steps) == 4
    cond = adapter.encode_prompts([prompt])
    shared = adapter.encode_guidance(Guidance(scale, ""))
    assert bool(shared) == (layout == "klein")
    xs, expected = [], []
    for i, (noise_pred, t, sample) in enumerate(steps):
        assert torch.allclose(sigmas[i] * 1000, t)
        x = sample.transpose(1, 2).reshape(1, c, h, w)
        v = adapter.velocity({"x": x}, sigmas[i : i + 1], cond, shared, scale)["x"]
        torch.testing.assert_close(v.flatten(2).transpose(1, 2), noise_pred, rtol=0, atol=1e-5)
        xs.append(x), expected.append(noise_pred)
    every = {"prompt_embeds": cond["prompt_embeds"].expand(4, -1, -1)}
    batch = adapter.velocity({"x": torch.cat(xs)}, sigmas[:4], every, shared, scale)["x"]
    torch.testing.assert_close(batch.flatten(2).transpose(1, 2), torch.cat(expected), rtol=0, atol=1e-5)
    if layout in ("klein", "dev"):  # the check can tell: without guidance the velocity is another
        plain = adapter.velocity({"x": xs[0]}, sigmas[:1], cond, {}, 1.0)["x"]
        assert (plain.flatten(2).transpose(1, 2) - expected[0]).abs().max() > 1e-3
    images = adapter.decode({"x": final["latents"].transpose(1, 2).reshape(1, c, h, w)})["images"]
    assert images.shape == out.images.shape == (1, 3, height, width)
    torch.testing.assert_close(images, out.images, rtol=0, atol=1e-5)


def test_encode_media_inverts_the_batch_norm_normalisation(adapters):
    adapter = adapters["klein"]
    images = torch.rand(2, 3, 32, 32)
    x = adapter.encode_media({"images": images})["x"]
    assert x.shape == (2, 32, 8, 8)
    vae = adapter.vae
    with torch.no_grad():
        z = vae.encode(images * 2 - 1).latent_dist.mode()
        direct = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
    torch.testing.assert_close(x * std + vae.bn.running_mean.view(1, -1, 1, 1), patchify(z), rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter.decode({"x": x})["images"], direct, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- errors
def test_what_each_layout_refuses(adapters, flux2_dirs, tmp_path):
    assert [adapters[k].layout for k in LAYOUTS] == ["klein", "klein", "dev", "klein"]
    assert [adapters[k].is_distilled for k in LAYOUTS] == [False, True, False, True]
    assert adapters["dev"].default_lora_targets == FLUX2_LORA_TARGETS
    with pytest.raises(ValueError, match=r"step-distilled FLUX.2 Klein has no guidance: rollout.guidance_scale=4.0"):
        adapters["klein-distilled"].encode_guidance(Guidance(4.0))
    assert adapters["dev"].encode_guidance(Guidance(4.0)) == {}  # the embedding needs no shared conditioning
    assert adapters["klein"].encode_guidance(Guidance(1.0)) == {}  # CFG off
    with pytest.raises(ValueError, match=r"FLUX.2 generates from text only, but a prompt carries \['images'\]"):
        adapters["klein"].encode_prompts([{"text": "a", "images": ["x.png"]}])
    with pytest.raises(ValueError, match="multiples of 4 for FLUX.2, got 34x32"):
        adapters["klein"].latent_shapes(MediaShape(34, 32))
    import shutil

    other = tmp_path / "not_flux2"
    shutil.copytree(flux2_dirs["klein"], other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="names 'FluxPipeline'; a FLUX.2 checkpoint is one of Flux2KleinPipeline"):
        _adapter(other)


# ----------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_flops_match_the_executed_ops(guidance_embeds):
    """flux2_forward_flops vs what Flux2Transformer2DModel runs: 2·(output elements)·(fan-in) per Linear call (the
    shared modulation and the embedders run on (B, d): once per sample) and 4·B·S²·(H·D) per attention call."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.models.transformers import transformer_flux2

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 4, 4, 4),
                                    guidance_embeds=guidance_embeds).eval()
    batch, text, (rows, cols) = 3, 7, (3, 4)
    with count_flops(model, dispatch_attention(transformer_flux2)) as executed, torch.no_grad():
        model(hidden_states=torch.randn(batch, rows * cols, 16), encoder_hidden_states=torch.randn(batch, text, 24),
              timestep=torch.full((batch,), 0.5), guidance=torch.full((batch,), 4.0) if guidance_embeds else None,
              img_ids=token_ids(rows, cols), txt_ids=text_ids(text))
    assert executed.attention_calls == 5
    assert flux2_forward_flops(model.config, rows * cols, text) * batch == pytest.approx(executed.flops, rel=1e-12)


# ----------------------------------------------------------------------------------------------- CLI
def test_two_steps_of_the_recipe_through_the_cli(flux2_dirs, shape_prompts_file, tmp_path):
    """The Klein recipe (CFG 4 with the empty negative prompt, one SDE step in [1, 3]) on the tiny Klein base."""
    out = tmp_path / "run"
    args = ["train", "recipe=flux2_flowgrpo", f"model.path={flux2_dirs['klein']}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={out}", "model.dtype=float32", f"model.max_sequence_length={MAX_LEN}",
            "trainer.max_steps=2", "rollout.height=32", "rollout.width=32", "rollout.num_steps=4", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", "actor.micro_batch_size=2", "trainer.eval_every=2",
            "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=2", "trainer.progress=false",
            "trainer.tensorboard=false", "reward=jpeg_compressibility"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["grad_norm"] > 0 and math.isfinite(rows[1]["loss"]) and rows[1]["perf/tflops"] > 0
    assert math.isfinite(rows[2]["eval/reward_mean"]) and (out / "samples" / "step_000002.png").is_file()
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    trained = {k.split(".lora_")[0] for k, v in state.items() if k.endswith("lora_B.weight") and v.abs().max() > 0}
    for target in ("attn.to_q", "attn.add_v_proj", "ff.linear_in", "ff_context.linear_out", "attn.to_qkv_mlp_proj"):
        assert any(k.endswith(target) for k in trained), target


def test_recipe_is_flow_factorys_klein_workload():
    """Flow-Factory's FLUX.2-klein-base GRPO LoRA: 384², 8 steps, CFG 4, one SDE step drawn from steps 1..3 at noise
    0.7, 16 images per prompt, 48 prompts and 2 updates per step, LoRA r64 α128, group-std advantages."""
    from polyrl.config import load_config

    cfg = load_config(["recipe=flux2_flowgrpo", "model.path=/x", "data.path=/y.txt", "reward.path=/z"])
    r, a = cfg.rollout, cfg.actor
    assert cfg.model.name == "flux2" and cfg.reward.name == "pickscore"
    assert (r.height, r.width, r.num_steps, r.guidance_scale, r.noise_level, r.n) == (384, 384, 8, 4.0, 0.7, 16)
    assert (r.step, r.sde_window_size, list(r.sde_window_range)) == ("sde", 1, [1, 3])
    assert (a.lora_rank, a.lora_alpha, a.lr, a.num_minibatches, a.micro_batch_size) == (64, 128.0, 3e-4, 2, 1)
    assert cfg.algorithm.adv_std == "group" and cfg.algorithm.kl_beta == 0 and cfg.data.prompts_per_step == 48
