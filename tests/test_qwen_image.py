"""The Qwen-Image adapter against diffusers' QwenImagePipeline, its pure pieces against float64 references, and
a CLI run on a tiny saved pipeline."""

import json
import math

import numpy as np
import pytest
import torch
from flop_count import count_flops, dispatch_attention
from omegaconf import OmegaConf

from polyrl.cli.main import main
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.models.qwen_image import (
    PROMPT_TEMPLATE,
    TEMPLATE_DROP,
    dynamic_shift_mu,
    pack_latents,
    true_cfg,
    unpack_latents,
)
from polyrl.models.tiny import TinyQwenImageSpec, build_tiny_qwen_image, qwen_image_bench_spec, save_tiny_qwen_image
from polyrl.sampling.diffusion import RolloutNoise, SamplingPlan, sample_latents

PROMPTS = ["two red circles above a blue square", "a green triangle", "three yellow squares"]


@pytest.fixture(scope="module")
def tiny_qwen_dir(tmp_path_factory):
    words = sorted({w for p in PROMPTS for w in p.split()})
    return save_tiny_qwen_image(TinyQwenImageSpec(words=words, image_size=32), tmp_path_factory.mktemp("tiny_qwen"))


@pytest.fixture(scope="module")
def adapter(tiny_qwen_dir):
    cfg = OmegaConf.create({"name": "qwen_image", "path": str(tiny_qwen_dir), "dtype": "float32", "max_sequence_length": 512})
    return build_model(cfg, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------- pure pieces
def test_pack_puts_each_2x2_patch_in_one_token_and_unpack_inverts_it():
    x = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    tokens = pack_latents(x)
    assert tokens.shape == (2, 3 * 2, 12)
    for b in range(2):
        for i in range(3):
            for j in range(2):
                for c in range(3):
                    for r in range(2):
                        for s in range(2):
                            assert tokens[b, i * 2 + j, c * 4 + r * 2 + s] == x[b, c, 2 * i + r, 2 * j + s]
    assert torch.equal(unpack_latents(tokens, 6, 4), x)
    with pytest.raises(ValueError, match="must be even"):
        pack_latents(torch.zeros(1, 1, 3, 4))


def test_pack_matches_the_pipeline_packing():
    from diffusers import QwenImagePipeline

    x = torch.randn(2, 4, 8, 6)
    ours = pack_latents(x)
    assert torch.equal(ours, QwenImagePipeline._pack_latents(x, 2, 4, 8, 6))
    # the pipeline unpacks to a video frame axis; vae_scale_factor 8 maps a 64x48 image to this 8x6 grid
    assert torch.equal(unpack_latents(ours, 8, 6), QwenImagePipeline._unpack_latents(ours, 64, 48, 8)[:, :, 0])


def test_true_cfg_matches_float64_reference():
    rng = np.random.default_rng(0)
    v_u, v_c = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    s = 4.0
    expected = np.empty_like(v_u)
    for b in range(2):
        for t in range(5):
            comb = [v_u[b, t, k] * (1 - s) + s * v_c[b, t, k] for k in range(8)]
            scale = math.sqrt(sum(c * c for c in v_c[b, t])) / math.sqrt(sum(c * c for c in comb))
            expected[b, t] = [c * scale for c in comb]
    got = true_cfg(torch.from_numpy(v_u), torch.from_numpy(v_c), s)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
    # every token keeps the conditional velocity's norm; scale 1 is the conditional velocity itself
    np.testing.assert_allclose(got.norm(dim=-1).numpy(), np.linalg.norm(v_c, axis=-1), rtol=1e-12)
    assert torch.allclose(true_cfg(torch.from_numpy(v_u), torch.from_numpy(v_c), 1.0), torch.from_numpy(v_c))


def test_dynamic_shift_mu_interpolates_between_base_and_max():
    assert dynamic_shift_mu(256, 256, 8192, 0.5, 0.9) == pytest.approx(0.5)
    assert dynamic_shift_mu(8192, 256, 8192, 0.5, 0.9) == pytest.approx(0.9)
    assert dynamic_shift_mu(1024, 256, 8192, 0.5, 0.9) == pytest.approx(0.5 + 0.4 * 768 / 7936)


def _noise(adapter, batch: int, size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn((batch, *adapter.latent_shapes(MediaShape(size, size))["x"]), generator=generator)


def _velocity(adapter, x, sigma, cond, shared=None, guidance=1.0):
    return adapter.velocity({"x": x}, sigma, cond, shared or {}, guidance)["x"]


def _expected_sigmas(num_steps: int, image_tokens: int) -> np.ndarray:
    """Qwen-Image's published scheduler, by hand in float64: exponential shift e^μ/(e^μ + 1/t − 1), then the
    stretch that makes the last nonzero sigma 0.02, then 0."""
    mu = 0.5 + (0.9 - 0.5) * (image_tokens - 256) / (8192 - 256)
    t = np.array([1 - k * (1 - 1 / num_steps) / (num_steps - 1) for k in range(num_steps)])
    shifted = np.exp(mu) / (np.exp(mu) + (1 / t - 1))
    stretch = (1 - shifted[-1]) / (1 - 0.02)
    return np.append(1 - (1 - shifted) / stretch, 0.0)


@pytest.mark.parametrize("size,steps", [(32, 4), (128, 10)])
def test_sigmas_use_the_resolution_dependent_shift(adapter, size, steps):
    """128² on the tiny VAE (factor 2) is 1024 image tokens, the token count of 512² on the real one (factor 8)."""
    image_tokens = (size // adapter.vae_scale_factor // 2) ** 2
    got = adapter.sigmas(steps, MediaShape(size, size))
    assert got.dtype == torch.float32 and got.shape == (steps + 1,)
    np.testing.assert_allclose(got.numpy(), _expected_sigmas(steps, image_tokens), atol=2e-7)
    assert got[0] == 1.0 and got[-2] == pytest.approx(0.02, abs=1e-6) and got[-1] == 0.0


def test_tiny_tokenizer_header_is_the_34_dropped_tokens(adapter):
    header = PROMPT_TEMPLATE.split("{}")[0]
    assert len(adapter.tokenizer(header).input_ids) == TEMPLATE_DROP


# ----------------------------------------------------------------------------------------------- vs the pipeline
def _pipeline(path):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ode(adapter, prompts, noise, steps, guidance):
    cond = adapter.encode_prompts(prompts)
    plan = SamplingPlan(num_steps=steps, shape=MediaShape(32, 32), guidance=Guidance(guidance), noise_level=0.0)
    draws = RolloutNoise({"x": noise}, torch.zeros(len(prompts), dtype=torch.long),
                         {"x": torch.randn(steps, len(prompts), *noise.shape[1:])})
    out = sample_latents(adapter, cond, adapter.encode_guidance(plan.guidance), draws, plan)
    return out[4]["x"]  # the final latent


def test_ode_sampling_reproduces_the_diffusers_pipeline(adapter, tiny_qwen_dir):
    """Same initial latents, 4 steps, true CFG 4 with an empty negative prompt, prompts of different lengths (so
    the text padding mask matters): the adapter's Euler ODE rollout and decode equal QwenImagePipeline's."""
    prompts = PROMPTS[:2]
    noise = _noise(adapter, 2, 32, torch.Generator().manual_seed(0))
    assert adapter.encode_prompts(prompts)["prompt_mask"].sum(1).unique().numel() == 2  # really padded
    final = _ode(adapter, prompts, noise, 4, 4.0)
    pipe = _pipeline(tiny_qwen_dir)
    kwargs = dict(prompt=prompts, negative_prompt=[""] * 2, true_cfg_scale=4.0, height=32, width=32,
                  num_inference_steps=4, latents=pack_latents(noise))
    reference = unpack_latents(pipe(**kwargs, output_type="latent").images, 16, 16)
    assert (final - reference).abs().max() < 1e-5
    # the check can tell: plain CFG (no norm rescale) or no guidance lands far away
    assert (_ode(adapter, prompts, noise, 4, 1.0) - reference).abs().max() > 1e-2
    images = pipe(**kwargs, output_type="pt").images
    ours = adapter.decode({"x": final})["images"]
    assert ours.shape == images.shape == (2, 3, 32, 32)
    assert (ours - images).abs().max() < 1e-5


def test_cfg_velocity_is_not_plain_cfg(adapter):
    prompts = PROMPTS[:2]
    x = _noise(adapter, 2, 32, torch.Generator().manual_seed(3))
    sigma = torch.full((2,), 0.7)
    cond, shared = adapter.encode_prompts(prompts), adapter.encode_guidance(Guidance(4.0, ""))
    neg = {k: v.expand(2, *v.shape[1:]) for k, v in shared.items()}
    v_c = _velocity(adapter, x, sigma, cond)
    v_u = _velocity(adapter, x, sigma, neg)
    v = _velocity(adapter, x, sigma, cond, shared, 4.0)
    expected = unpack_latents(true_cfg(pack_latents(v_u), pack_latents(v_c), 4.0), 16, 16)
    assert (v - expected).abs().max() < 1e-5
    assert (v - (v_u + 4.0 * (v_c - v_u))).abs().max() > 1e-2


def test_padding_the_text_does_not_change_the_velocity(adapter):
    x = _noise(adapter, 1, 32, torch.Generator().manual_seed(4))
    cond = adapter.encode_prompts(["a green triangle"])
    padded = {"prompt_embeds": torch.cat([cond["prompt_embeds"], torch.randn(1, 5, cond["prompt_embeds"].shape[-1])], 1),
              "prompt_mask": torch.cat([cond["prompt_mask"], torch.zeros(1, 5, dtype=torch.bool)], 1)}
    sigma = torch.full((1,), 0.5)
    assert (_velocity(adapter, x, sigma, cond) - _velocity(adapter, x, sigma, padded)).abs().max() < 1e-5


def test_encode_images_undoes_the_decode_normalisation(adapter):
    images = torch.rand(2, 3, 32, 32)
    latents = adapter.encode_media({"images": images})
    assert latents["x"].shape == (2, 4, 16, 16)
    raw = adapter.vae.encode(images.unsqueeze(2) * 2 - 1).latent_dist.mean
    direct = (adapter.vae.decode(raw, return_dict=False)[0][:, :, 0] / 2 + 0.5).clamp(0, 1)
    assert (adapter.decode(latents)["images"] - direct).abs().max() < 1e-5


def test_image_size_must_tile_the_patches(adapter):
    with pytest.raises(ValueError, match="multiples of 4 for Qwen-Image, got 30x32"):
        adapter.latent_shapes(MediaShape(30, 32))


# ----------------------------------------------------------------------------------------------- bench build
def test_bench_spec_is_the_published_size():
    """docs/benchmark.md: 60 layers, 24 heads × 128, 20.4 B transformer parameters (built on the meta device through the
    same builder that saves the tiny pipeline above)."""
    pipe = build_tiny_qwen_image(qwen_image_bench_spec(["a"]), device="meta", dtype=torch.bfloat16)
    t = pipe.transformer
    assert (t.config.num_layers, t.config.num_attention_heads, t.config.attention_head_dim) == (60, 24, 128)
    assert (t.config.in_channels, t.config.joint_attention_dim) == (64, 3584)
    assert t.dtype == torch.bfloat16
    assert sum(p.numel() for p in t.parameters()) / 1e9 == pytest.approx(20.43, abs=0.01)
    assert pipe.text_encoder.config.text_config.hidden_size == 3584
    assert pipe.vae.config.z_dim == 16 and len(pipe.vae.config.temperal_downsample) == 3


# ----------------------------------------------------------------------------------------------- CLI
def test_two_steps_on_tiny_qwen_image_through_the_cli(tiny_qwen_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    args = [  # Flow-GRPO with a KL term (recipe=toy_flow_grpo; the default recipe is DiffusionNFT)
        "train", "recipe=toy_flow_grpo", "model=qwen_image", f"model.path={tiny_qwen_dir}",
        f"data.path={shape_prompts_file}", f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.height=32",
        "rollout.width=32", "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
        "rollout.guidance_scale=4.0", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
        "trainer.eval_every=0", "trainer.save_every=2", "trainer.progress=false", "trainer.tensorboard=false",
        "reward=jpeg_compressibility", "algorithm.kl_beta=0.04",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["grad_norm"] > 0 and math.isfinite(rows[0]["loss"]) and rows[0]["kl"] >= 0
    assert rows[0]["perf/tflops"] > 0
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    trained = {k.split(".lora_")[0] for k, v in state.items() if k.endswith("lora_B.weight") and v.abs().max() > 0}
    for target in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj"):
        assert any(k.endswith(target) for k in trained), target


# ----------------------------------------------------------------------------------------------- FLOPs
def test_flops_match_the_executed_ops_of_the_transformer():
    """docs/algorithms.md §6 count vs what the model runs: 2·(output elements)·(fan-in) for every Linear call (per-sample
    modulation linears run on (B, d), so they count once per sample) and 4·B·S²·(H·D) for every joint attention."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers import transformer_qwenimage

    from polyrl.models.qwen_image import qwen_image_forward_flops

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)).eval()
    batch, text, grid = 3, 7, (6, 4)
    tokens = (grid[0] // 2) * (grid[1] // 2)
    with count_flops(model, dispatch_attention(transformer_qwenimage)) as executed, torch.no_grad():
        model(hidden_states=torch.randn(batch, tokens, 16), encoder_hidden_states=torch.randn(batch, text, 24),
              timestep=torch.full((batch,), 0.5), img_shapes=[[(1, grid[0] // 2, grid[1] // 2)]] * batch)
    assert executed.attention_calls == 3
    assert qwen_image_forward_flops(model.config, tokens, text) * batch == pytest.approx(executed.flops, rel=1e-12)


def test_full_size_forward_flops_by_hand():
    """Qwen-Image at 512² (1024 image tokens) + 100 text tokens, counted by hand: d = 3072, 60 blocks of 24·d² token
    weights per (image, text) token pair of streams, so 2·(N+T)·12d² per block, + attention 4·(N+T)²·d, + the
    per-sample img_mod/txt_mod (2 × d·6d), the embedders and the output layers."""
    from types import SimpleNamespace

    from polyrl.models.qwen_image import qwen_image_forward_flops

    c = SimpleNamespace(num_attention_heads=24, attention_head_dim=128, num_layers=60, patch_size=2, in_channels=64,
                        out_channels=16, joint_attention_dim=3584)
    d, n, t = 3072, 1024, 100
    blocks = 60 * (2 * (n + t) * 12 * d * d + 4 * (n + t) ** 2 * d + 2 * 12 * d * d)
    io = 2 * n * 64 * d + 2 * t * 3584 * d + 2 * n * d * 64 + 2 * (256 * d + d * d) + 2 * (2 * d * d)
    assert qwen_image_forward_flops(c, n, t) == blocks + io
    # ≈ 16.2 TFLOP per sample forward: docs/benchmark.md's 327 ms for batch 8 at 49% of 802 TFLOP/s is 16.1 TFLOP/sample
    assert qwen_image_forward_flops(c, n, t) / 1e12 == pytest.approx(16.2, abs=0.1)


def test_recipe_is_the_verl_omni_qwen_image_workload():
    """docs/benchmark.md second workload: 512², 10 steps, SDE window 2, true CFG 4, LoRA r64, 16 images per prompt."""
    from polyrl.config import load_config

    cfg = load_config(["recipe=qwen_image_flowgrpo", "model.path=/x", "data.path=/y.txt", "data.prompts_per_step=8"])
    r, a = cfg.rollout, cfg.actor
    assert cfg.model.name == "qwen_image" and cfg.model.dtype == "bfloat16"
    assert (r.height, r.width, r.num_steps, r.sde_window_size, r.guidance_scale, r.n) == (512, 512, 10, 2, 4.0, 16)
    assert list(r.sde_window_range) == [0, 5] and r.noise_level == 1.2
    assert (a.lora_rank, a.lora_alpha, a.lr) == (64, 128.0, 3e-4) and a.lora_targets is None
    assert cfg.data.prompts_per_step == 8  # prompts per step is a key (the recipe's 32 by default)
