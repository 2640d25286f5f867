"""Z-Image against diffusers' ZImagePipeline on a tiny pipeline the test builds and saves: the text conditioning, the
guided denoiser output (CFG, its normalisation and truncation, and no guidance as for Z-Image-Turbo) at every step of
a pipeline run, the sigma grid, decode, the FLOP count against the executed ops, and the recipe through the CLI."""

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
from polyrl.models.z_image import (
    Z_IMAGE_LORA_TARGETS,
    guided_steps,
    padded_tokens,
    z_image_forward_flops,
    z_image_guidance,
)

WORDS = sorted({w for p in SHAPE_PROMPTS for w in p.split()})
MAX_LEN = 40
SCHEDULERS = {  # Z-Image-Turbo's published scheduler (static shift 3), and a dynamic-shift one
    "static": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    "dynamic": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                    base_image_seq_len=256, max_image_seq_len=4096),
}


def save_tiny_z_image(path, scheduler: dict, seed: int = 0):
    """A random-weight ZImagePipeline: ZImageTransformer2DModel (d 32, 2 heads, 2 layers, 1 refiner layer each),
    AutoencoderKL (4 latent channels, ÷2, scaling 0.5 / shift 0.1), a 2-layer Qwen3Model, and a word-level tokenizer
    with Qwen3's chat template (built offline)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    from polyrl.models.tiny import QWEN3_CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab["\n"] = len(vocab)
    for w in [*WORDS, "user", "assistant"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        model_max_length=MAX_LEN, padding_side="right", chat_template=QWEN3_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)).eval()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])
    with torch.no_grad():  # the pad tokens start at zero: make them count
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
        norm_num_groups=8, scaling_factor=0.5, shift_factor=0.1)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def z_dirs(tmp_path_factory):
    return {name: save_tiny_z_image(tmp_path_factory.mktemp(f"z_image_{name}"), sched, seed=i)
            for i, (name, sched) in enumerate(SCHEDULERS.items())}


def _adapter(path, **options):
    cfg = {"name": "z_image", "path": str(path), "dtype": "float32", "max_sequence_length": MAX_LEN, "options": options}
    return build_model(OmegaConf.create(cfg), torch.device("cpu"))


def _pipeline(path):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ----------------------------------------------------------------------------------------------- pure pieces
def test_guidance_math_in_float64():
    torch.manual_seed(0)
    v_c, v_u = torch.randn(3, 4, 2, 2, dtype=torch.float64), torch.randn(3, 4, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(z_image_guidance(v_c, v_u, 4.0, 0.0), v_c + 3.0 * (v_c - v_u), rtol=0, atol=1e-12)
    out = z_image_guidance(v_c, v_u, 4.0, 1.2)
    for i in range(3):  # each sample capped at 1.2·‖v_c‖ if above it, untouched otherwise
        raw = v_c[i] + 3.0 * (v_c[i] - v_u[i])
        limit = 1.2 * v_c[i].norm()
        expected = raw * (limit / raw.norm()) if raw.norm() > limit else raw
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-12)
    assert (out.flatten(1).norm(dim=1) <= 1.2 * v_c.flatten(1).norm(dim=1) + 1e-12).all()
    # truncation at τ: guided where (1000 − 1000σ)/1000 ≤ τ; τ > 1 never truncates
    sigma = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.1])
    assert guided_steps(sigma, 0.2, 1000).tolist() == [True, True, True, False, False]
    assert guided_steps(sigma, 1.5, 1000).all()
    assert [padded_tokens(n) for n in (1, 32, 33, 64)] == [32, 32, 64, 64]


def test_sigmas_are_the_schedulers_shift(z_dirs):
    """Static shift s: sσ/(1 + (s − 1)σ) of σ = linspace(1, 1/N, N); dynamic: e^μ/(e^μ + 1/σ − 1) with μ from the
    image token count, both by hand in float64."""
    for name, size, steps in (("static", 32, 4), ("dynamic", 64, 6)):
        got = _adapter(z_dirs[name]).sigmas(steps, MediaShape(size, size))
        t = np.linspace(1.0, 1.0 / steps, steps)
        if name == "static":
            expected = 3.0 * t / (1 + 2.0 * t)
        else:
            tokens = (size // 2 // 2) ** 2  # VAE ÷2, 2×2 patches
            mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256)
            expected = np.exp(mu) / (np.exp(mu) + (1 / t - 1))
        assert got.dtype == torch.float32 and got.shape == (steps + 1,) and got[-1] == 0
        np.testing.assert_allclose(got[:-1].numpy(), expected, atol=2e-7)


# ----------------------------------------------------------------------------------------------- vs the pipeline
def test_text_conditioning_equals_encode_prompt(z_dirs):
    adapter, pipe = _adapter(z_dirs["static"]), _pipeline(z_dirs["static"])
    prompts = [SHAPE_PROMPTS[0], "", " ".join(WORDS * 4)]  # the long prompt is cut at max_sequence_length
    cond = adapter.encode_prompts(prompts)
    theirs, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=MAX_LEN)
    assert cond["prompt_mask"].sum(1).tolist() == [t.shape[0] for t in theirs]
    assert theirs[2].shape[0] == MAX_LEN
    for e, m, t in zip(cond["prompt_embeds"], cond["prompt_mask"], theirs, strict=True):
        torch.testing.assert_close(e[m], t, rtol=0, atol=1e-6)


CASES = {  # name -> (scheduler, pipeline guidance_scale s, cfg_normalization, cfg_truncation)
    "cfg": ("static", 3.0, 0.0, 1.0),
    "normalized_truncated": ("dynamic", 3.0, 1.0, 0.3),
    "turbo_no_guidance": ("static", 0.0, 0.0, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_velocity_equals_the_pipeline_denoiser(case, z_dirs):
    """Run the pipeline (4 steps, 32×48) and record the velocity it hands the scheduler at every step: the adapter's
    velocity (CFG weight w = s + 1) at the same latents and σ equals it; then every step in one batch (guided and
    truncated steps mixed), and the decoded image."""
    sched, s, normalization, truncation = CASES[case]
    adapter = _adapter(z_dirs[sched], cfg_normalization=normalization, cfg_truncation=truncation)
    pipe = _pipeline(z_dirs[sched])
    steps, step = [], pipe.scheduler.step

    def recording(model_output, timestep, sample, **kw):
        steps.append((model_output.clone(), timestep.clone(), sample.clone()))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = recording
    prompt, height, width = SHAPE_PROMPTS[1], 32, 48
    final = {}
    out = pipe(prompt=prompt, height=height, width=width, num_inference_steps=4, guidance_scale=s,
               cfg_normalization=normalization, cfg_truncation=truncation, max_sequence_length=MAX_LEN,
               generator=torch.Generator().manual_seed(0), output_type="pt",
               callback_on_step_end=lambda p, i, t, kw: final.update(kw) or {})
    shape = MediaShape(height, width)
    assert adapter.latent_shapes(shape)["x"] == (4, 16, 24)
    sigmas = adapter.sigmas(4, shape)
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and len(steps) == 4
    w = s + 1.0
    cond = adapter.encode_prompts([prompt])
    shared = adapter.encode_guidance(Guidance(w, ""))
    assert bool(shared) == (s > 0)
    guided = guided_steps(sigmas[:4], truncation, 1000)
    if case == "normalized_truncated":  # the case covers both kinds of step
        assert guided.any() and not guided.all()
    xs, expected = [], []
    for i, (noise_pred, t, sample) in enumerate(steps):
        assert torch.allclose(sigmas[i] * 1000, t)
        v = adapter.velocity({"x": sample}, sigmas[i : i + 1], cond, shared, w)["x"]
        torch.testing.assert_close(v, noise_pred, rtol=0, atol=1e-5)
        xs.append(sample), expected.append(noise_pred)
    every = {k: v.expand(4, *v.shape[1:]) for k, v in cond.items()}
    batch = adapter.velocity({"x": torch.cat(xs)}, sigmas[:4], every, shared, w)["x"]
    torch.testing.assert_close(batch, torch.cat(expected), rtol=0, atol=1e-5)
    if s > 0:  # the check can tell: the conditional velocity, or guidance without the options, is another
        plain = adapter.velocity({"x": xs[0]}, sigmas[:1], cond, {}, 1.0)["x"]
        assert (plain - expected[0]).abs().max() > 1e-3
    if normalization > 0:
        bare = _adapter(z_dirs[sched]).velocity({"x": xs[0]}, sigmas[:1], cond, shared, w)["x"]
        assert (bare - expected[0]).abs().max() > 1e-3
    images = adapter.decode({"x": final["latents"]})["images"]
    assert images.shape == out.images.shape == (1, 3, height, width)
    torch.testing.assert_close(images, out.images, rtol=0, atol=1e-5)


def test_a_samples_velocity_does_not_depend_on_its_batch(z_dirs):
    """Prompts of different lengths in one batch (padded, masked) give each prompt's velocity alone."""
    adapter = _adapter(z_dirs["static"])
    prompts = [SHAPE_PROMPTS[0], "a green triangle"]
    cond = adapter.encode_prompts(prompts)
    assert cond["prompt_mask"].sum(1).tolist()[0] > cond["prompt_mask"].sum(1).tolist()[1]
    x, sigma = torch.randn(2, 4, 8, 8), torch.tensor([0.9, 0.4])
    shared = adapter.encode_guidance(Guidance(4.0, "blurry"))
    both = adapter.velocity({"x": x}, sigma, cond, shared, 4.0)["x"]
    for i, p in enumerate(prompts):
        alone = adapter.velocity({"x": x[i : i + 1]}, sigma[i : i + 1], adapter.encode_prompts([p]), shared, 4.0)["x"]
        torch.testing.assert_close(both[i : i + 1], alone, rtol=0, atol=1e-5)


def test_encode_media_inverts_decode_normalisation(z_dirs):
    adapter = _adapter(z_dirs["static"])
    images = torch.rand(2, 3, 32, 32)
    x = adapter.encode_media({"images": images})["x"]
    with torch.no_grad():
        z = adapter.vae.encode(images * 2 - 1).latent_dist.mode()
        direct = (adapter.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(x, (z - 0.1) * 0.5, rtol=0, atol=1e-6)
    torch.testing.assert_close(adapter.decode({"x": x})["images"], direct, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- errors
def test_what_it_refuses(z_dirs):
    from polyrl.config import load_config
    from polyrl.config.schema import ConfigError
    from polyrl.errors import UserError

    adapter = _adapter(z_dirs["static"])
    assert adapter.default_lora_targets == Z_IMAGE_LORA_TARGETS and adapter.encode_guidance(Guidance(1.0)) == {}
    with pytest.raises(ValueError, match=r"Z-Image generates from text only, but a prompt carries \['images'\]"):
        adapter.encode_prompts([{"text": "a", "images": ["x.png"]}])
    with pytest.raises(ValueError, match="multiples of 4 for Z-Image, got 34x32"):
        adapter.latent_shapes(MediaShape(34, 32))
    with pytest.raises(UserError, match=r"model.options.cfg_truncation='high' is not valid \(default: 1.0\)"):
        _adapter(z_dirs["static"], cfg_truncation="high")
    with pytest.raises(ConfigError, match=r"unknown key model.options.cfg_scale for model.name=z_image; allowed: "
                                          r"cfg_normalization, cfg_truncation"):
        load_config(["recipe=z_image_flowgrpo", "model.path=/x", "data.path=/y.txt", "reward.path=/z",
                     "+model.options.cfg_scale=2"])


# ----------------------------------------------------------------------------------------------- FLOPs
def test_flops_match_the_executed_ops():
    """z_image_forward_flops vs what ZImageTransformer2DModel runs: 2·(output elements)·(fan-in) per Linear call (the
    AdaLN and timestep linears run on (B, ·): once per sample) and 4·B·Sq·Sk·(H·D) per attention call; 15 image tokens
    and 7 caption tokens are each padded to 32."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.models.transformers import transformer_z_image

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
                                     n_refiner_layers=2, n_heads=3, n_kv_heads=3, cap_feat_dim=24, axes_dims=[4, 6, 6],
                                     axes_lens=[256, 64, 64]).eval()
    batch, text, (rows, cols) = 3, 7, (6, 10)
    with count_flops(model, dispatch_attention(transformer_z_image)) as executed, torch.no_grad():
        model([torch.randn(4, 1, rows, cols) for _ in range(batch)], torch.full((batch,), 0.5),
              [torch.randn(text, 24) for _ in range(batch)])
    assert executed.attention_calls == 2 + 2 + 2
    tokens = (rows // 2) * (cols // 2)
    assert z_image_forward_flops(model.config, tokens, text) * batch == pytest.approx(executed.flops, rel=1e-12)


# ----------------------------------------------------------------------------------------------- CLI
def test_two_steps_of_the_recipe_through_the_cli(z_dirs, shape_prompts_file, tmp_path):
    """The recipe (CFG weight 5 with the empty negative prompt, one SDE step in [1, 3]) on the tiny pipeline."""
    out = tmp_path / "run"
    args = ["train", "recipe=z_image_flowgrpo", f"model.path={z_dirs['static']}", f"data.path={shape_prompts_file}",
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
    for target in Z_IMAGE_LORA_TARGETS:
        assert any(k.endswith(target) for k in trained), target


def test_recipe_is_flow_factorys_z_image_workload():
    """Flow-Factory's Z-Image GRPO LoRA: 512², 10 steps, guidance_scale 4 (CFG weight 5), one SDE step drawn from steps
    1..3 at noise 0.7, 16 images per prompt, 48 prompts and 2 updates per step, LoRA r64 α128, group-std advantages."""
    from polyrl.config import load_config

    cfg = load_config(["recipe=z_image_flowgrpo", "model.path=/x", "data.path=/y.txt", "reward.path=/z"])
    r, a = cfg.rollout, cfg.actor
    assert cfg.model.name == "z_image" and cfg.reward.name == "pickscore"
    assert (r.height, r.width, r.num_steps, r.guidance_scale, r.noise_level, r.n) == (512, 512, 10, 5.0, 0.7, 16)
    assert (r.step, r.sde_window_size, list(r.sde_window_range)) == ("sde", 1, [1, 3])
    assert (a.lora_rank, a.lora_alpha, a.lr, a.num_minibatches, a.micro_batch_size) == (64, 128.0, 3e-4, 2, 1)
    assert cfg.algorithm.adv_std == "group" and cfg.algorithm.kl_beta == 0 and cfg.data.prompts_per_step == 48
    assert dict(cfg.model.options) == {"cfg_normalization": 0.0, "cfg_truncation": 1.0}
