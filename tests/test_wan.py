"""The Wan adapter against diffusers' own WanPipeline: text conditioning, the guided denoiser output at every step
of a pipeline run (Wan2.1, Wan2.2-TI2V with per-token timesteps, a two-expert A14B layout), decode; plus the
latent layout, the sigma grid and the analytic FLOP count against the executed operations."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from flop_count import executed_flops

from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.models.tiny import TinyWanSpec, build_tiny_wan
from polyrl.models.wan import WAN_LORA_TARGETS, WanPolicy, wan_forward_flops, wan_sigmas

WORDS = "a red cat jumps over the blue dog slowly in rain bright overexposed static blurred".split()
PROMPT, NEGATIVE = "a red  cat jumps over the blue dog &amp; rain ", "bright overexposed static blurred"
MAX_LEN = 16
LAYOUTS = {  # name -> (spec kwargs, video size (frames, height, width), extra model_index.json entries)
    "wan2.1": (dict(layout="wan2.1"), (5, 32, 48), {}),
    "wan2.2-ti2v": (dict(layout="wan2.2-ti2v"), (5, 64, 32), {}),
    # Wan2.2-A14B: the Wan2.1 VAE, two experts switched at t = 0.9·1000, a second guidance scale
    "wan2.2-a14b": (dict(layout="wan2.1", boundary_ratio=0.9), (5, 32, 32), {"guidance_scale_2": 2.5}),
}


def _cfg(path, **kw):
    return SimpleNamespace(**{"name": "wan", "path": str(path), "dtype": "float32", "max_sequence_length": MAX_LEN,
                              "compile": "none", "fp8": False, **kw})


@pytest.fixture(scope="module", params=list(LAYOUTS))
def wan(request, tmp_path_factory):
    """(layout name, in-memory WanPipeline, the adapter loaded from its save_pretrained directory)."""
    spec_kw, _, index_extra = LAYOUTS[request.param]
    pipe = build_tiny_wan(TinyWanSpec(words=WORDS, **spec_kw), seed=1)
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    pipe.save_pretrained(str(path))
    if index_extra:
        index = json.loads((path / "model_index.json").read_text())
        (path / "model_index.json").write_text(json.dumps({**index, **index_extra}))
    return request.param, pipe, WanPolicy(_cfg(path), torch.device("cpu"))


def test_text_conditioning_equals_encode_prompt(wan):
    _, pipe, policy = wan
    long_prompt = " ".join(WORDS * 2)  # 32 words: truncated to MAX_LEN tokens
    prompts = [PROMPT, NEGATIVE, long_prompt]
    ours = policy.encode_prompts(prompts)["prompt_embeds"]
    theirs, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN)
    assert ours.shape == theirs.shape == (3, MAX_LEN, pipe.text_encoder.config.d_model)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours[0, 12:].abs().sum() == 0 and ours[2].abs().sum(-1).ne(0).all()  # zero-padded / truncated


def test_velocity_equals_wanpipeline_denoiser(wan):
    """Run WanPipeline (FlowMatchEuler with the checkpoint's shift: float timesteps σ·1000) and record the guided
    noise prediction it hands the scheduler at every step; the adapter's batched-CFG velocity at the same latents
    and σ must equal it. Then one batch mixing all steps (both experts for A14B) must give the same."""
    name, pipe, policy = wan
    _, (frames, height, width), index_extra = LAYOUTS[name]
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=policy.shift)
    scale = 5.0
    steps = []
    step = pipe.scheduler.step

    def recording_step(model_output, timestep, sample, **kw):
        steps.append((model_output.clone(), timestep, sample.clone()))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = recording_step
    final = {}
    out = pipe(PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=frames, num_inference_steps=4,
               guidance_scale=scale, guidance_scale_2=index_extra.get("guidance_scale_2"), generator=torch.Generator().manual_seed(0), output_type="pt",
               max_sequence_length=MAX_LEN, callback_on_step_end=lambda p, i, t, kw: final.update(kw) or {})
    sigmas = pipe.scheduler.sigmas
    assert len(steps) == 4
    cond = policy.encode_prompts([PROMPT])
    shared = policy.encode_guidance(Guidance(scale, NEGATIVE))
    xs, sigs, expected = [], [], []
    for i, (noise_pred, t, sample) in enumerate(steps):
        sigma = sigmas[i : i + 1]
        assert torch.equal(sigma * 1000, t.reshape(1))  # the same float32 timestep reaches the network
        v = policy.velocity({"x": sample}, sigma, cond, shared, scale)["x"]
        torch.testing.assert_close(v, noise_pred, rtol=0, atol=1e-5)
        xs.append(sample), sigs.append(sigma), expected.append(noise_pred)
    if name == "wan2.2-a14b":
        high = [bool(policy.high_noise(s)) for s in sigs]
        assert any(high) and not all(high)  # the run crossed the boundary: both experts and both scales were used
        assert [t >= 900 for _, t, _ in steps] == high
    # every step in one batch (A14B: split by expert inside, each half with its own network and guidance scale)
    batch = policy.velocity({"x": torch.cat(xs)}, torch.cat(sigs), cond | {"prompt_embeds": cond["prompt_embeds"].expand(4, -1, -1)},
                            shared, scale)["x"]
    torch.testing.assert_close(batch, torch.cat(expected), rtol=0, atol=1e-5)
    # decode: WanPipeline's own denormalisation, VAE decode and postprocessing
    video = policy.decode({"x": final["latents"]})["video"]
    assert video.shape == (1, frames, 3, height, width)
    torch.testing.assert_close(video, out.frames, rtol=0, atol=1e-6)


def test_expert_routing_follows_boundary(wan):
    name, _, policy = wan
    if name != "wan2.2-a14b":
        assert set(policy.modules()) == {"transformer"}
        assert policy.network_for(torch.tensor([0.1, 0.99])) is policy.modules()["transformer"]
        return
    nets = policy.modules()
    assert set(nets) == {"transformer", "transformer_2"}
    assert policy.network_for(torch.tensor([0.9, 1.0])) is nets["transformer"]  # t = 900 ≥ 0.9·1000
    assert policy.network_for(torch.tensor([0.899, 0.1])) is nets["transformer_2"]
    with pytest.raises(ValueError, match="both sides"):
        policy.network_for(torch.tensor([0.95, 0.5]))


def test_guidance_scale_2_option_overrides_the_checkpoint(wan):
    """model.options.guidance_scale_2 sets the low-noise expert's CFG scale: its velocity equals the one computed with
    that scale by hand (v_u + s₂·(v_c − v_u)), and the high-noise expert keeps the rollout's scale."""
    name, _, policy = wan
    if name != "wan2.2-a14b":
        return
    tuned = WanPolicy(_cfg(policy.root, options={"guidance_scale_2": 1.7}), torch.device("cpu"))
    assert policy.guidance_scale_2 == 2.5 and tuned.guidance_scale_2 == 1.7
    frames, height, width = LAYOUTS[name][1]
    shape = policy.latent_shapes(MediaShape(height=height, width=width, frames=frames))["x"]
    x = {"x": torch.randn(2, *shape, generator=torch.Generator().manual_seed(5))}
    sigma = torch.tensor([0.95, 0.3])  # one sample per expert
    cond = tuned.encode_prompts([PROMPT, PROMPT])
    shared = tuned.encode_guidance(Guidance(5.0, NEGATIVE))
    with torch.no_grad():
        v = tuned.velocity(x, sigma, cond, shared, 5.0)["x"]
        v_c = tuned._forward(x, sigma, cond)["x"]
        v_u = tuned._forward(x, sigma, {"prompt_embeds": shared["prompt_embeds"].expand(2, -1, -1)})["x"]
    torch.testing.assert_close(v[0], (v_u + 5.0 * (v_c - v_u))[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(v[1], (v_u + 1.7 * (v_c - v_u))[1], rtol=0, atol=1e-5)


def test_latent_shapes_and_errors(wan):
    name, _, policy = wan
    ti2v = name == "wan2.2-ti2v"
    s = 16 if ti2v else 8  # the tiny VAEs have the published compression factors
    assert policy.latent_shapes(MediaShape(height=64, width=128, frames=9)) == {"x": (48 if ti2v else 16, 3, 64 // s, 128 // s)}
    assert policy.latent_shapes(MediaShape(height=64, width=64, frames=1))["x"][1] == 1
    with pytest.raises(ValueError, match="Wan generates video: rollout.num_frames"):
        policy.latent_shapes(MediaShape(height=64, width=64, frames=0))
    with pytest.raises(ValueError, match=r"rollout.num_frames=8 must be 4k\+1.*9"):
        policy.latent_shapes(MediaShape(height=64, width=64, frames=8))
    with pytest.raises(ValueError, match=f"rollout.height={3 * s} must be a multiple of {2 * s}"):
        policy.latent_shapes(MediaShape(height=3 * s, width=64, frames=5))
    with pytest.raises(ValueError, match=f"rollout.width={s} must be a multiple of {2 * s}"):
        policy.latent_shapes(MediaShape(height=64, width=s, frames=5))


def test_decode_and_encode_media_roundtrip_the_normalisation(wan):
    name, _, policy = wan
    frames, height, width = LAYOUTS[name][1]
    shape = policy.latent_shapes(MediaShape(height=height, width=width, frames=frames))["x"]
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(3))
    video = policy.decode({"x": x})["video"]
    assert video.shape == (2, frames, 3, height, width) and video.min() >= 0 and video.max() <= 1
    vae = policy.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        direct = vae.decode(x * std + mean).sample.permute(0, 2, 1, 3, 4) * 0.5 + 0.5
        torch.testing.assert_close(video, direct.clamp(0, 1), rtol=0, atol=1e-5)
        z = policy.encode_media({"video": video})["x"]
        posterior = vae.encode(video.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mean
    assert z.shape == x.shape
    torch.testing.assert_close(z * std + mean, posterior, rtol=0, atol=1e-5)


def test_decode_slices_only_large_chunks_with_the_same_result(wan, monkeypatch):
    import polyrl.models.wan as wan_module

    name, _, policy = wan
    frames, height, width = LAYOUTS[name][1]
    shape = policy.latent_shapes(MediaShape(height=height, width=width, frames=frames))["x"]
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(4))
    assert policy.decoded_pixels(x) == frames * height * width
    batched = policy.decode({"x": x})["video"]
    assert not policy.vae.use_slicing  # 3 tiny videos: one batch
    monkeypatch.setattr(wan_module, "SLICE_ABOVE_PIXELS", 2 * frames * height * width)
    sliced = policy.decode({"x": x})["video"]
    assert policy.vae.use_slicing  # above the limit: video by video
    torch.testing.assert_close(sliced, batched, rtol=0, atol=1e-5)


def test_sigmas_are_the_shifted_flow_grid(tiny_wan_dir):
    policy = WanPolicy(_cfg(tiny_wan_dir), torch.device("cpu"))
    assert policy.shift == 3.0  # the tiny Wan2.1 scheduler: UniPC with flow_shift 3.0, as published for 1.3B
    n = 10
    sig = policy.sigmas(n, MediaShape(height=32, width=32, frames=5))
    u = [1 - i / n for i in range(n + 1)]
    want = torch.tensor([3 * a / (1 + 2 * a) for a in u], dtype=torch.float64)
    assert sig.dtype == torch.float32 and sig[0] == 1 and sig[-1] == 0
    torch.testing.assert_close(sig.double(), want, rtol=0, atol=1e-7)
    # UniPC applies the same shift to its own base grid linspace(1, 1/1000, N+1)[:-1] (then σ_0 −= 1e-6)
    sched = policy.load("scheduler")
    sched.set_timesteps(n)
    base = torch.linspace(1, 1 / 1000, n + 1, dtype=torch.float64)[:-1]
    torch.testing.assert_close(sched.sigmas[1:-1].double(), (3 * base / (1 + 2 * base))[1:], rtol=0, atol=1e-6)
    assert torch.equal(WanPolicy(_cfg(tiny_wan_dir, shift=7.0), torch.device("cpu")).sigmas(n), wan_sigmas(n, 7.0))


def test_build_model_registry(tiny_wan_dir):
    from polyrl.models import MODELS, build_model

    assert "wan" in MODELS
    policy = build_model(_cfg(tiny_wan_dir), torch.device("cpu"))
    assert isinstance(policy, WanPolicy) and policy.default_lora_targets == WAN_LORA_TARGETS


# ----------------------------------------------------------------------------------------------- FLOPs, LoRA
@pytest.mark.parametrize("per_token_timesteps", [False, True])
def test_wan_flops_match_executed_ops(per_token_timesteps):
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=6,
                                  out_channels=5, text_dim=20, freq_dim=16, ffn_dim=40, num_layers=3).eval()
    batch, text, f, h, w = 3, 7, 2, 4, 6
    tokens = f * (h // 2) * (w // 2)
    t = torch.full((batch,), 500.0)
    inputs = dict(hidden_states=torch.randn(batch, 6, f, h, w), encoder_hidden_states=torch.randn(batch, text, 20),
                  timestep=t[:, None].expand(-1, tokens) if per_token_timesteps else t)
    executed, attention_calls = executed_flops(model, inputs)
    assert attention_calls == 2 * 3  # self- and cross-attention per block
    analytic = wan_forward_flops(model.config, tokens, text, per_token_timesteps=per_token_timesteps)
    assert analytic * batch == pytest.approx(executed, rel=1e-12)


def test_adapter_counts_its_forward_flops(wan):
    name, _, policy = wan
    frames, height, width = LAYOUTS[name][1]
    shape = policy.latent_shapes(MediaShape(height=height, width=width, frames=frames))["x"]
    cond = policy.encode_prompts([PROMPT, PROMPT])
    before = policy.flops
    with torch.no_grad():
        policy.velocity({"x": torch.zeros(2, *shape)}, torch.tensor([0.5, 0.5]), cond,
                        policy.encode_guidance(Guidance(3.0, NEGATIVE)), 3.0)
    tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
    per = wan_forward_flops(policy.transformer.config, tokens, MAX_LEN, per_token_timesteps=name == "wan2.2-ti2v")
    assert policy.flops - before == pytest.approx(4 * per)  # 2 samples × (uncond + cond)


def test_lora_targets_name_every_block_projection():
    from peft import LoraConfig

    model = build_tiny_wan(TinyWanSpec(words=WORDS)).transformer
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in WAN_LORA_TARGETS:
        hits = [n for n in names if n.endswith("." + target)]
        assert len(hits) == model.config.num_layers, target
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=WAN_LORA_TARGETS))
    lora = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(lora) == len(WAN_LORA_TARGETS) * model.config.num_layers


def test_decode_runs_in_the_network_precision(wan, monkeypatch):
    """A bf16 network decodes under bf16 autocast (float32 weights): close to the float32 decode, not equal to it."""
    name, _, policy = wan
    frames, height, width = LAYOUTS[name][1]
    shape = policy.latent_shapes(MediaShape(height=height, width=width, frames=frames))["x"]
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(5))
    exact = policy.decode({"x": x})["video"]
    monkeypatch.setattr(policy, "dtype", torch.bfloat16)
    low = policy.decode({"x": x})["video"]
    assert low.dtype == torch.float32 and next(policy.vae.parameters()).dtype == torch.float32
    difference = (low - exact).abs().max().item()
    assert 0 < difference < 0.05, difference


def test_compiled_decoder_decodes_as_the_eager_one(tiny_wan_dir, monkeypatch):
    """model.compile other than none compiles the VAE decoder (one graph per feature-cache state): same videos.
    Dynamo's capture of the cache-mutating decoder is what is tested; its graphs run eagerly here (inductor's CPU
    compilation of them takes 40 s)."""
    module_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: module_compile(self, backend="eager"))
    compiled = WanPolicy(_cfg(tiny_wan_dir, compile="blocks"), torch.device("cpu"))
    eager = WanPolicy(_cfg(tiny_wan_dir), torch.device("cpu"))
    assert hasattr(compiled.vae.decoder, "_compiled_call_impl") and compiled.vae.decoder._compiled_call_impl is not None
    assert getattr(eager.vae.decoder, "_compiled_call_impl", None) is None
    shape = eager.latent_shapes(MediaShape(height=32, width=32, frames=5))["x"]
    x = {"x": torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))}
    torch.testing.assert_close(compiled.decode(x)["video"], eager.decode(x)["video"], rtol=0, atol=1e-5)
