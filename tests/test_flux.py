"""FLUX.1-dev, FLUX.1-schnell and FLUX.1-Kontext against diffusers' FluxPipeline / FluxKontextPipeline on tiny
saved pipelines: the guided denoiser output at every step of a pipeline run (embedded guidance, true CFG, schnell's
none, Kontext's sequence-concatenated condition), the sigma grid, decode, the FLOP count against the executed ops,
and the recipes through the CLI.

Kontext's pipeline resizes its condition to a ≈1024² trained resolution unless called with `_auto_resize=False` and
`max_area=H*W` (it would also rescale the output): the reference runs get the condition already resized to the
adapter's `condition_size`, which the pipeline then keeps."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import EDIT_PROMPTS, SHAPE_PROMPTS
from flop_count import count_flops, dispatch_attention
from omegaconf import OmegaConf
from PIL import Image

from polyrl.cli.main import main
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.models.flux import (
    FLUX_KONTEXT_LORA_TARGETS,
    FLUX_LORA_TARGETS,
    KONTEXT_RESOLUTIONS,
    flux_forward_flops,
    image_ids,
    kontext_condition_dims,
)
from polyrl.models.qwen_image import pack_latents, unpack_latents
from polyrl.models.tiny import TinyFluxSpec, save_tiny_flux

WORDS = sorted({w for p in SHAPE_PROMPTS + EDIT_PROMPTS for w in p.split()} | {"blurry"})
MAX_LEN = 16  # T5 tokens
SIDE = 64  # Kontext condition size of the tests (published: 1024)
GUIDANCE, TRUE_CFG, NEGATIVE = 3.5, 2.0, "blurry"


@pytest.fixture(scope="module")
def flux_dirs(tmp_path_factory):
    """layout -> a tiny saved pipeline directory."""
    return {layout: save_tiny_flux(TinyFluxSpec(words=WORDS, layout=layout), tmp_path_factory.mktemp(f"flux_{layout}"),
                                   seed=i) for i, layout in enumerate(("dev", "schnell", "kontext"))}


def _adapter(path, name="flux", **kw):
    cfg = {"name": name, "path": str(path), "dtype": "float32", "max_sequence_length": MAX_LEN, "true_cfg_scale": 1.0,
           "condition_size": SIDE, **kw}
    return build_model(OmegaConf.create(cfg), torch.device("cpu"))


def _pipeline(path, kontext=False):
    from diffusers import FluxKontextPipeline, FluxPipeline

    pipe = (FluxKontextPipeline if kontext else FluxPipeline).from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _record_steps(pipe) -> list:
    """Wrap the pipeline's scheduler step: each call's (denoiser output, timestep, sample), packed."""
    steps, step = [], pipe.scheduler.step

    def recording(model_output, timestep, sample, **kw):
        steps.append((model_output.clone(), timestep.clone(), sample.clone()))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = recording
    return steps


# ----------------------------------------------------------------------------------------------- pure pieces
def test_packing_and_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 8, 6)
    assert torch.equal(pack_latents(x), FluxPipeline._pack_latents(x, 2, 4, 8, 6))
    # vae_scale_factor 8 maps a 64×48 image to this 8×6 latent
    assert torch.equal(unpack_latents(pack_latents(x), 8, 6), FluxPipeline._unpack_latents(pack_latents(x), 64, 48, 8))
    assert torch.equal(image_ids(4, 3), FluxPipeline._prepare_latent_image_ids(1, 4, 3, "cpu", torch.float32))
    ids = image_ids(2, 3, frame=1)
    assert ids[:, 0].eq(1).all() and ids[4].tolist() == [1, 1, 1]  # token 4: row 1, column 1


def test_kontext_condition_dims_is_the_pipelines_auto_resize(flux_dirs, monkeypatch):
    """At the published size 1024 the condition goes where FluxKontextPipeline(_auto_resize=True) puts it (the
    pipeline run is stopped once it has preprocessed the image); other sizes scale those resolutions."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert list(KONTEXT_RESOLUTIONS) == list(PREFERRED_KONTEXT_RESOLUTIONS)
    pipe = _pipeline(flux_dirs["kontext"], kontext=True)
    seen = []

    class Stop(Exception):
        pass

    def stop(image, *args, **kwargs):
        seen.append(tuple(image.shape[-2:]))
        raise Stop

    monkeypatch.setattr(pipe, "prepare_latents", stop)
    for width, height in [(48, 40), (32, 80), (333, 777), (1920, 1080), (64, 64)]:
        with pytest.raises(Stop):
            pipe(image=Image.new("RGB", (width, height)), prompt="a", height=32, width=32, max_sequence_length=MAX_LEN)
        assert kontext_condition_dims(width, height, 1024)[::-1] == seen[-1]  # (w, h) vs the tensor's (h, w)
    assert kontext_condition_dims(48, 40, 64) == (64, 48)  # 1104×944 nearest 1.2, ÷16, floored to 16
    assert kontext_condition_dims(32, 80, 64) == (32, 96)  # 672×1568


@pytest.mark.parametrize("layout", ["dev", "schnell"])
def test_sigmas_are_the_pipelines_shifted_grid(flux_dirs, layout):
    """dev: exponential shift e^μ/(e^μ + 1/t − 1) of t = linspace(1, 1/N, N), μ = 0.5 + 0.65·(N_tok − 256)/3840, by
    hand in float64; schnell: no shift."""
    adapter = _adapter(flux_dirs[layout])
    size, steps = 64, 6  # 64² on the tiny VAE (÷2) is 16×16 packed tokens = 256: μ = base_shift
    got = adapter.sigmas(steps, MediaShape(size, size))
    t = np.linspace(1.0, 1.0 / steps, steps)
    tokens = (size // 2 // 2) ** 2
    mu = 0.5 + 0.65 * (tokens - 256) / 3840
    want = np.exp(mu) / (np.exp(mu) + (1 / t - 1)) if layout == "dev" else t
    assert got.dtype == torch.float32 and got.shape == (steps + 1,) and got[-1] == 0
    np.testing.assert_allclose(got[:-1].numpy(), want, atol=2e-7)
    if layout == "dev":  # a bigger image shifts more
        assert (adapter.sigmas(steps, MediaShape(256, 256))[1:-1] > got[1:-1]).all()


# ----------------------------------------------------------------------------------------------- vs the pipelines
CASES = {  # name -> (layout, adapter kwargs, pipeline kwargs)
    "dev": ("dev", {}, dict(guidance_scale=GUIDANCE)),
    "dev-true-cfg": ("dev", {"true_cfg_scale": TRUE_CFG},
                     dict(guidance_scale=GUIDANCE, true_cfg_scale=TRUE_CFG, negative_prompt=NEGATIVE)),
    "schnell": ("schnell", {}, {}),
    "schnell-true-cfg": ("schnell", {"true_cfg_scale": TRUE_CFG}, dict(true_cfg_scale=TRUE_CFG, negative_prompt=NEGATIVE)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_velocity_equals_the_pipeline_denoiser(case, flux_dirs):
    """Run the pipeline (4 steps, 32×48) and record the noise prediction it hands the scheduler at every step: the
    adapter's velocity at the same latents and σ equals it (embedded guidance 3.5; true CFG 2 on top; schnell
    without guidance, and with true CFG). Then every step in one batch, and the decoded final latents."""
    layout, adapter_kw, pipe_kw = CASES[case]
    adapter = _adapter(flux_dirs[layout], **adapter_kw)
    pipe = _pipeline(flux_dirs[layout])
    steps = _record_steps(pipe)
    prompt, height, width = SHAPE_PROMPTS[0], 32, 48
    final = {}
    out = pipe(prompt=prompt, height=height, width=width, num_inference_steps=4, max_sequence_length=MAX_LEN,
               generator=torch.Generator().manual_seed(0), output_type="pt",
               callback_on_step_end=lambda p, i, t, kw: final.update(kw) or {}, **pipe_kw)
    shape = MediaShape(height, width)
    grid = adapter.latent_shapes(shape)["x"][1:]
    sigmas = adapter.sigmas(4, shape)
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and len(steps) == 4
    scale = pipe_kw.get("guidance_scale", 1.0)
    cond = adapter.encode_prompts([prompt])
    shared = adapter.encode_guidance(Guidance(scale, NEGATIVE))
    assert bool(shared) == case.endswith("true-cfg")
    xs, expected = [], []
    for i, (noise_pred, t, sample) in enumerate(steps):
        assert torch.allclose(sigmas[i] * 1000, t)
        x = unpack_latents(sample, *grid)
        v = adapter.velocity({"x": x}, sigmas[i : i + 1], cond, shared, scale)["x"]
        torch.testing.assert_close(pack_latents(v), noise_pred, rtol=0, atol=1e-5)
        xs.append(x), expected.append(noise_pred)
    batch = adapter.velocity({"x": torch.cat(xs)}, sigmas[:4], {k: v.expand(4, *v.shape[1:]) for k, v in cond.items()},
                             shared, scale)["x"]
    torch.testing.assert_close(pack_latents(batch), torch.cat(expected), rtol=0, atol=1e-5)
    # the check can tell: another guidance value (or none) lands elsewhere
    other = adapter.velocity({"x": xs[0]}, sigmas[:1], cond, shared, 1.0 if scale != 1.0 else 4.0)["x"]
    differs = (pack_latents(other) - expected[0]).abs().max()
    assert differs > 1e-3 if layout == "dev" else differs < 1e-6  # schnell ignores guidance: refused below
    images = adapter.decode({"x": unpack_latents(final["latents"], *grid)})["images"]
    assert images.shape == out.images.shape == (1, 3, height, width)
    torch.testing.assert_close(images, out.images, rtol=0, atol=1e-5)


def _resized_condition(pipe, path: str, side: int) -> Image.Image:
    """The source image already at the adapter's condition size, as the pipeline's own resize makes it."""
    image = Image.open(path).convert("RGB")
    w, h = kontext_condition_dims(*image.size, side)
    return pipe.image_processor.resize(image, h, w)


@pytest.mark.parametrize("true_cfg", [1.0, TRUE_CFG])
def test_kontext_velocity_equals_the_pipeline_denoiser(true_cfg, flux_dirs, edit_data_dir):
    """Per sample, the Kontext pipeline (condition pre-resized, `_auto_resize=False`, `max_area=H*W`, 3 steps,
    guidance 2.5, with and without true CFG): the adapter's velocity at every recorded step equals the pipeline's;
    then the two samples, whose conditions have other grids (two transformer calls), in one batch."""
    adapter = _adapter(flux_dirs["kontext"], name="flux_kontext", true_cfg_scale=true_cfg)
    shared = adapter.encode_guidance(Guidance(2.5, NEGATIVE))
    assert bool(shared) == (true_cfg > 1)
    cfg_kw = dict(true_cfg_scale=true_cfg, negative_prompt=NEGATIVE) if true_cfg > 1 else {}
    pipe = _pipeline(flux_dirs["kontext"], kontext=True)
    prompts = [{"text": EDIT_PROMPTS[0], "images": [str(edit_data_dir / "images" / "a.png")]},
               {"text": EDIT_PROMPTS[1], "images": [str(edit_data_dir / "images" / "b.png")]}]
    cond = adapter.encode_prompts(prompts)
    assert cond["condition_grids"][:, 0].tolist() == [[12, 16], [24, 8]]  # 64×48 and 32×96 px, VAE ÷2, packed ÷2
    height = width = 32
    grid = adapter.latent_shapes(MediaShape(height, width))["x"][1:]
    sigmas = adapter.sigmas(3, MediaShape(height, width))
    xs, expected, sigs = [], [], []
    for prompt in prompts:
        steps = _record_steps(pipe)
        pipe(image=_resized_condition(pipe, prompt["images"][0], SIDE), prompt=prompt["text"], height=height,
             width=width, max_area=height * width, _auto_resize=False, num_inference_steps=3, guidance_scale=2.5,
             max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(1), output_type="latent", **cfg_kw)
        assert torch.equal(sigmas, pipe.scheduler.sigmas)
        xs.append(torch.cat([unpack_latents(s, *grid) for _, _, s in steps]))
        expected.append(torch.cat([p for p, _, _ in steps]))
        sigs.append(sigmas[:3])
    one = adapter.encode_prompts(prompts[:1])
    one = {k: t.expand(3, *t.shape[1:]) for k, t in one.items()}
    v = adapter.velocity({"x": xs[0]}, sigs[0], one, shared, 2.5)["x"]
    torch.testing.assert_close(pack_latents(v), expected[0], rtol=0, atol=1e-5)
    both = {k: t.repeat_interleave(3, 0) for k, t in cond.items()}
    v = adapter.velocity({"x": torch.cat(xs)}, torch.cat(sigs), both, shared, 2.5)["x"]
    torch.testing.assert_close(pack_latents(v), torch.cat(expected), rtol=0, atol=1e-5)
    # the condition matters: the first sample's latents with the second sample's condition land elsewhere
    swapped = {k: t[1:].expand(3, *t.shape[1:]) for k, t in cond.items()}
    moved = adapter.velocity({"x": xs[0]}, sigs[0], swapped, shared, 2.5)["x"] - unpack_latents(expected[0], *grid)
    assert moved.abs().max() > 1e-3


def test_encode_media_undoes_decode_normalisation(flux_dirs):
    adapter = _adapter(flux_dirs["dev"])
    images = torch.rand(2, 3, 32, 32)
    latents = adapter.encode_media({"images": images})
    assert latents["x"].shape == (2, 4, 16, 16)
    vae, cfg = adapter.vae, adapter.vae.config
    with torch.no_grad():
        raw = vae.encode(images * 2 - 1).latent_dist.mean
        direct = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(latents["x"], (raw - cfg.shift_factor) * cfg.scaling_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(adapter.decode(latents)["images"], direct, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- errors
def test_what_each_variant_refuses(flux_dirs, edit_data_dir):
    dev, schnell = _adapter(flux_dirs["dev"]), _adapter(flux_dirs["schnell"])
    kontext = _adapter(flux_dirs["kontext"], name="flux_kontext")
    assert dev.default_lora_targets == FLUX_LORA_TARGETS and kontext.default_lora_targets == FLUX_KONTEXT_LORA_TARGETS
    assert kontext.condition_images and not dev.condition_images
    with pytest.raises(ValueError, match=r"without a guidance embedding \(schnell\).*rollout.guidance_scale=3.5"):
        schnell.encode_guidance(Guidance(3.5))
    assert schnell.encode_guidance(Guidance(1.0)) == {} and dev.encode_guidance(Guidance(3.5, NEGATIVE)) == {}
    image = str(edit_data_dir / "images" / "a.png")
    with pytest.raises(ValueError, match=r"FLUX.1 generates from text only, but a prompt carries \['images'\]"):
        dev.encode_prompts([{"text": "a", "images": [image]}])
    with pytest.raises(ValueError, match="FLUX.1-Kontext edits a condition image, but the prompt 'a' carries none"):
        kontext.encode_prompts(["a"])
    with pytest.raises(ValueError, match="takes 1 condition image per prompt, got 2"):
        kontext.encode_prompts([{"text": "a", "images": [image, image]}])
    with pytest.raises(ValueError, match="multiples of 4 for FLUX.1, got 30x32"):
        dev.latent_shapes(MediaShape(30, 32))
    with pytest.raises(ValueError, match="must be <= 512"):
        _adapter(flux_dirs["dev"], max_sequence_length=513)


# ----------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_flops_match_the_executed_ops(guidance_embeds):
    """flux_forward_flops vs what FluxTransformer2DModel runs: 2·(output elements)·(fan-in) per Linear call
    (per-sample embedders and modulation run on (B, d): once per sample) and 4·B·S²·(H·D) per attention call."""
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers import transformer_flux

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20,
                                   guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6)).eval()
    batch, text, tokens = 3, 7, 12
    with count_flops(model, dispatch_attention(transformer_flux)) as executed, torch.no_grad():
        model(hidden_states=torch.randn(batch, tokens, 16), encoder_hidden_states=torch.randn(batch, text, 24),
              pooled_projections=torch.randn(batch, 20), timestep=torch.full((batch,), 0.5),
              guidance=torch.full((batch,), 3.5) if guidance_embeds else None, img_ids=image_ids(3, 4),
              txt_ids=torch.zeros(text, 3))
    assert executed.attention_calls == 5
    assert flux_forward_flops(model.config, tokens, text) * batch == pytest.approx(executed.flops, rel=1e-12)


def test_adapter_counts_the_kontext_condition_tokens(flux_dirs, edit_data_dir):
    """A true-CFG Kontext forward over samples with different conditions: the adapter's running count equals
    flux_forward_flops with each sample's noise + condition tokens (the formula itself is checked above)."""
    kontext = _adapter(flux_dirs["kontext"], name="flux_kontext", true_cfg_scale=TRUE_CFG)
    prompts = [{"text": EDIT_PROMPTS[0], "images": [str(edit_data_dir / "images" / n)]} for n in ("a.png", "c.png")]
    cond = kontext.encode_prompts(prompts)
    x = torch.randn(2, *kontext.latent_shapes(MediaShape(32, 32))["x"])
    before = kontext.flops
    with torch.no_grad():
        kontext.velocity({"x": x}, torch.full((2,), 0.6), cond, kontext.encode_guidance(Guidance(2.5, NEGATIVE)), 2.5)
    text = cond["prompt_embeds"].shape[1]
    conditions = [12 * 16, 16 * 16]  # a.png → 64×48 px, c.png (32×32) → 64×64 px: packed grids 12×16, 16×16
    want = 2 * sum(flux_forward_flops(kontext.transformer.config, 64 + m, text) for m in conditions)  # CFG: ×2
    assert kontext.flops - before == pytest.approx(want, rel=1e-12)


# ----------------------------------------------------------------------------------------------- CLI
def _edit_rows(data_dir, name, rows):
    path = data_dir / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


COMMON = ["model.dtype=float32", f"model.max_sequence_length={MAX_LEN}", "trainer.max_steps=2", "rollout.height=32",
          "rollout.width=32", "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
          "actor.micro_batch_size=2", "actor.num_minibatches=1", "rollout.sde_window_size=2",
          "rollout.sde_window_range=[0,1]", "trainer.eval_every=2", "trainer.eval_samples=2",
          "trainer.num_validation=2", "trainer.save_every=2", "trainer.progress=false", "trainer.tensorboard=false",
          "reward=jpeg_compressibility"]


@pytest.mark.parametrize("recipe", ["flux_flowgrpo", "flux_kontext_flowgrpo"])
def test_two_steps_of_the_recipe_through_the_cli(recipe, flux_dirs, shape_prompts_file, edit_data_dir, tmp_path):
    kontext = recipe == "flux_kontext_flowgrpo"
    data = shape_prompts_file
    if kontext:
        data = _edit_rows(edit_data_dir, "flux_kontext.jsonl", [{"prompt": EDIT_PROMPTS[0], "image": "images/a.png"},
                                                                 {"prompt": EDIT_PROMPTS[1], "image": "images/b.png"}])
    out = tmp_path / "run"
    args = ["train", f"recipe={recipe}", f"model.path={flux_dirs['kontext' if kontext else 'dev']}",
            f"data.path={data}", f"trainer.output_dir={out}", *COMMON]
    if kontext:
        args.append(f"model.condition_size={SIDE}")
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["grad_norm"] > 0 and math.isfinite(rows[1]["loss"]) and rows[1]["perf/tflops"] > 0
    assert math.isfinite(rows[2]["eval/reward_mean"]) and (out / "samples" / "step_000002.png").is_file()
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    trained = {k.split(".lora_")[0] for k, v in state.items() if k.endswith("lora_B.weight") and v.abs().max() > 0}
    targets = ["attn.to_q", "attn.add_k_proj", "ff.net.2", "ff_context.net.0.proj"] + (["proj_mlp"] if kontext else [])
    for target in targets:
        assert any(k.endswith(target) for k in trained), target
    assert any(k.startswith("transformer.single_transformer_blocks.") for k in trained)


def test_a_kontext_row_without_its_image_is_a_config_error(edit_data_dir, tmp_path, capsys):
    data = _edit_rows(edit_data_dir, "flux_missing_image.jsonl",
                      [{"prompt": EDIT_PROMPTS[0], "image": "images/a.png"}, {"prompt": EDIT_PROMPTS[1]}])
    code = main(["train", "recipe=flux_kontext_flowgrpo", f"model.path={tmp_path / 'none'}", f"data.path={data}",
                 f"trainer.output_dir={tmp_path / 'run'}", "reward=jpeg_compressibility"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"polyrl: config error: {data}:2: no 'image' (a path or a list of paths, relative to the data "
                   "file); model.name=flux_kontext needs a condition image in every row"]


def test_recipes_are_flow_grpos_flux_workloads():
    """flow_grpo's `pickscore_flux` and `counting_flux_kontext`: 512², 6 steps of which the first 5 trained,
    embedded guidance 3.5 / 2.5, noise 0.9, 24 / 21 images per prompt, 48 prompts per step, LoRA r64 α128."""
    from polyrl.config import load_config

    for recipe, guidance, n in (("flux_flowgrpo", 3.5, 24), ("flux_kontext_flowgrpo", 2.5, 21)):
        cfg = load_config([f"recipe={recipe}", "model.path=/x", "data.path=/y.jsonl", "reward.path=/z"])
        r, a = cfg.rollout, cfg.actor
        assert (r.height, r.width, r.num_steps, r.guidance_scale, r.noise_level, r.n) == (512, 512, 6, guidance, 0.9, n)
        assert (r.sde_window_size, list(r.sde_window_range)) == (5, [0, 0])
        assert (a.lora_rank, a.lora_alpha, a.lr, a.num_minibatches, a.micro_batch_size) == (64, 128.0, 3e-4, 2, 3)
        assert cfg.algorithm.kl_beta == 0 and cfg.algorithm.adv_std == "global" and cfg.data.prompts_per_step == 48
        assert cfg.model.max_sequence_length == 128 and cfg.model.true_cfg_scale == 1.0
        assert cfg.reward.name == "pickscore"
    assert cfg.model.name == "flux_kontext" and cfg.model.condition_size == 512 and cfg.algorithm.drop_zero_advantage
