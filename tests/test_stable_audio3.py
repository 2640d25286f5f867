"""The Stable Audio 3 adapter against diffusers' own StableAudio3Pipeline on a tiny random checkpoint the test builds
and saves: the cross-attention context, the velocity (CFG included) at every step of a pipeline run, the log-SNR
grid, decode; the pipeline's ping-pong step equals polyrl's `cps` step at noise level 1 drawn from the same noise;
the analytic FLOP count against the executed operations; and a 2-step CLI run of the recipe with `reward=clap`
that writes a wav and a spectrogram PNG."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from flop_count import executed_flops

from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.models.stable_audio3 import SA3_LORA_TARGETS, StableAudio3Policy, sa3_forward_flops, sa3_logsnr_sigmas
from polyrl.sampling.steps import cps_step

WORDS = "a dog barks loudly in the rain soft piano melody birds sing at dawn low quality noise".split()
PROMPT, NEGATIVE = "a dog barks loudly in the rain", "low quality noise"
RATE, RATIO = 4000, 16  # the tiny SAME VAE: 4 kHz, 16 samples per latent frame (patch 8, stride 2)
SECONDS = 0.3  # 75 latent frames


def build_tiny_sa3(words: list[str] = WORDS, seed: int = 0, differential: bool = True):
    """A tiny StableAudio3Pipeline with random weights: T5Gemma encoder (hidden 16, 1 layer), a 2-block DiT (embed 16,
    2 heads, 2 memory tokens, differential attention), the duration embedder and a SAME VAE (hop 16, stereo, 4 kHz, plain attention),
    with the distilled checkpoint's scheduler (FlowMatchEuler, stochastic_sampling, timesteps in [0, 1]). The DiT's
    zero-initialised pre/post convolutions and padding embedding, and the VAE's zero-initialised output layers, get
    random values so that they show."""
    from diffusers import AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel, StableAudio3Pipeline
    from diffusers.pipelines.stable_audio_3 import StableAudio3DurationEmbedder
    from transformers import T5GemmaConfig, T5GemmaEncoderModel, T5GemmaModuleConfig

    from polyrl.models.tiny import word_tokenizer

    tokenizer = word_tokenizer(words, 12, add_bos=True)
    torch.manual_seed(seed)
    module = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                  sliding_window=8, layer_types=["full_attention"])
    text_encoder = T5GemmaEncoderModel(T5GemmaConfig(encoder=T5GemmaModuleConfig(**module),
                                                     decoder=T5GemmaModuleConfig(**module), vocab_size=len(tokenizer),
                                                     is_encoder_decoder=False)).eval()
    duration = StableAudio3DurationEmbedder(output_dim=16, fourier_dim=8, max_val=32)
    transformer = StableAudio3DiTModel(io_channels=4, embed_dim=16, depth=2, num_heads=2, cond_token_dim=16,
                                       global_cond_dim=16, local_add_cond_dim=5, timestep_features_dim=8,
                                       num_memory_tokens=2, use_differential_attention=differential)
    with torch.no_grad():
        for conv in (transformer.preprocess_conv, transformer.postprocess_conv):
            conv.weight.normal_(0, 0.3)
        transformer.prompt_padding_embedding.normal_()
    vae = AutoencoderSAME(audio_channels=2, patch_size=8, encoder_channels=8, encoder_c_mults=[1], encoder_strides=[2],
                          encoder_transformer_depths=[1], latent_dim=4, dim_heads=8, sampling_rate=RATE,
                          use_differential_attention=False)
    with torch.no_grad():  # SAME zero-initialises its attention and FFN outputs: the waveform would ignore the latents
        for name, param in vae.named_parameters():
            if name.endswith("weight") and not param.any():
                param.normal_(0, 1.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, stochastic_sampling=True)
    return StableAudio3Pipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, duration_embedder=duration,
                                transformer=transformer, scheduler=scheduler)


def _cfg(path, **options):
    return SimpleNamespace(name="stable_audio_3", path=str(path), dtype="float32", max_sequence_length=12,
                           compile="none", fp8=False, options={"seconds": SECONDS, **options})


@pytest.fixture(scope="module")
def sa3(tmp_path_factory):
    pipe = build_tiny_sa3()
    path = tmp_path_factory.mktemp("sa3")
    pipe.save_pretrained(str(path))
    return pipe, path, StableAudio3Policy(_cfg(path), torch.device("cpu"))


def test_context_equals_the_pipelines_text_and_duration_tokens(sa3):
    pipe, _, policy = sa3
    prompts = [PROMPT, NEGATIVE, " ".join(WORDS)]  # the last one is truncated to 12 tokens
    ours = policy.encode_prompts(prompts)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompts, "cpu", 1)
        context, context_mask = pipe.prepare_cross_attention(embeds, mask, pipe.encode_duration(SECONDS, "cpu", 1, 3))
    assert ours["context"].shape == (3, 13, 16)
    torch.testing.assert_close(ours["context"], context, rtol=0, atol=1e-6)
    assert torch.equal(ours["context_mask"], context_mask)
    assert ours["context_mask"][0].sum() < 13 and ours["context_mask"][2].all()  # padded / truncated


def _record_run(pipe, guidance: float, negative: str | None, steps: int = 4, seed: int = 0):
    """Run the pipeline; record (velocity, timestep, latents, next latents) at every step, and the final latents."""
    scheduler, records = pipe.scheduler, []
    step = scheduler.step

    def recording_step(model_output, timestep, sample, **kw):
        out = step(model_output, timestep, sample, **kw)
        records.append((model_output.clone(), timestep, sample.clone(), out.prev_sample.clone()))
        return out

    scheduler.step = recording_step
    try:
        out = pipe(PROMPT, duration=SECONDS, num_inference_steps=steps, guidance_scale=guidance,
                   negative_prompt=negative, generator=torch.Generator().manual_seed(seed), output_type="latent")
    finally:
        del scheduler.step
    return records, out.audios, scheduler.sigmas.clone()


@pytest.mark.parametrize(("guidance", "negative"), [(1.0, None), (3.0, None), (3.0, NEGATIVE)])
def test_velocity_equals_the_pipelines_denoiser(sa3, guidance, negative):
    """At every step the adapter's (guided) velocity at the pipeline's latents and σ equals what the pipeline hands
    its scheduler; then all steps in one batch."""
    pipe, _, policy = sa3
    records, _, sigmas = _record_run(pipe, guidance, negative)
    torch.testing.assert_close(policy.sigmas(4), sigmas, rtol=0, atol=0)  # the same grid
    cond = policy.encode_prompts([PROMPT])
    shared = policy.encode_guidance(Guidance(guidance, negative or ""))
    xs, expected = [], []
    for i, (velocity, t, x, _) in enumerate(records):
        assert float(t) == pytest.approx(float(sigmas[i]))  # num_train_timesteps 1: the timestep is σ
        v = policy.velocity({"x": x}, sigmas[i : i + 1], cond, shared, guidance)["x"]
        torch.testing.assert_close(v, velocity, rtol=0, atol=1e-5)
        xs.append(x), expected.append(velocity)
    batch_cond = {k: t.expand(4, *t.shape[1:]) for k, t in cond.items()}
    batch = policy.velocity({"x": torch.cat(xs)}, sigmas[:4], batch_cond, shared, guidance)["x"]
    torch.testing.assert_close(batch, torch.cat(expected), rtol=0, atol=1e-5)


def test_the_ping_pong_step_is_cps_at_noise_level_one(sa3):
    """The scheduler's stochastic step x' = (1 − σ')·(x − σ·v) + σ'·ε, with ε drawn from the pipeline's generator in
    its order (initial latents, then one draw per step), equals polyrl's cps step at a = 1 with the same ε; its
    transition is N((1 − σ')·x̂0, σ'²), the density polyrl scores."""
    pipe, _, policy = sa3
    records, final, sigmas = _record_run(pipe, 1.0, None, seed=5)
    generator = torch.Generator().manual_seed(5)
    shape = records[0][2].shape
    torch.randn(shape, generator=generator)  # the initial latents
    for i, (velocity, _, x, prev) in enumerate(records):
        noise = torch.randn(shape, generator=generator)
        out = cps_step(x, velocity, sigmas[i], sigmas[i + 1], 1.0, float(sigmas[1]), noise=noise)
        torch.testing.assert_close(out.sample, prev, rtol=0, atol=1e-6)
        assert float(out.std[0]) == pytest.approx(float(sigmas[i + 1]))
    assert torch.equal(records[-1][3], final)  # the last step (σ' = 0) is x̂0 itself


def test_decode_equals_the_pipeline_and_encode_media_inverts_the_layout(sa3):
    pipe, _, policy = sa3
    _, latents, _ = _record_run(pipe, 1.0, None, steps=2)
    with torch.no_grad():
        audio = pipe.vae.decode(latents).sample[:, :, : int(SECONDS * RATE)].clamp(-1, 1)
    decoded = policy.decode({"x": latents})["audio"]
    assert decoded.sample_rate == RATE and decoded.waveform.shape == (1, 2, int(SECONDS * RATE))
    torch.testing.assert_close(decoded.waveform, audio, rtol=0, atol=1e-6)
    assert policy.latent_shapes(MediaShape()) == {"x": (4, math.ceil(SECONDS * RATE / RATIO))} == {"x": latents.shape[1:]}
    back = policy.encode_media({"audio": decoded})["x"]
    assert back.shape == latents.shape and torch.isfinite(back).all()


def test_grid_and_options(sa3, tmp_path):
    _, path, policy = sa3
    grid = sa3_logsnr_sigmas(8, -6.2, 2.0)
    assert grid[0] == 1.0 and grid.shape == (8,)
    torch.testing.assert_close(grid[1:], torch.sigmoid(-(2.0 - torch.linspace(1, 0, 9)[1:-1] * 8.2)))
    full = policy.sigmas(8)
    assert full.shape == (9,) and full[0] == 1.0 and full[-1] == 0.0 and bool((full[1:] < full[:-1]).all())
    with pytest.raises(ValueError, match="set model.options.seconds=1"):
        policy.latent_shapes(MediaShape(seconds=1.0))
    from polyrl.errors import UserError

    with pytest.raises(UserError, match="model.options.seconds=-1 must be > 0"):
        StableAudio3Policy(_cfg(path, seconds=-1.0), torch.device("cpu"))
    padded = StableAudio3Policy(_cfg(path, silence_padding_seconds=0.1), torch.device("cpu"))
    assert padded.latent_shapes(MediaShape())["x"][1] == math.ceil(0.4 * RATE / RATIO)


# ----------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("differential", [True, False])
def test_sa3_flops_match_executed_ops(differential):
    model = build_tiny_sa3(differential=differential).transformer.eval()
    batch, frames, context = 3, 20, 9
    inputs = dict(hidden_states=torch.randn(batch, 4, frames), timestep=torch.rand(batch),
                  encoder_hidden_states=torch.randn(batch, context, 16), global_hidden_states=torch.randn(batch, 16),
                  encoder_attention_mask=torch.ones(batch, context, dtype=torch.bool), return_dict=False)
    executed, attention_calls = executed_flops(model, inputs)
    assert attention_calls == 2 * model.config.depth * (2 if differential else 1)
    assert sa3_forward_flops(model.config, frames, context) * batch == pytest.approx(executed, rel=1e-12)


def test_lora_targets_are_every_blocks_attention_and_feed_forward():
    model = build_tiny_sa3().transformer
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in SA3_LORA_TARGETS:
        assert len([n for n in names if n.endswith("." + target)]) == model.config.depth, target


# ----------------------------------------------------------------------------------------------- the recipe, end to end
def test_recipe_trains_two_steps_and_writes_a_wav_and_a_spectrogram(tmp_path):
    from PIL import Image
    from safetensors.torch import load_file
    from test_clap import build_tiny_clap

    from polyrl.cli.main import main
    from polyrl.rewards.codec import decode_wav
    from polyrl.trainer.audio_samples import GAP_SECONDS

    model, clap = tmp_path / "sa3", tmp_path / "clap"
    build_tiny_sa3().save_pretrained(str(model))
    build_tiny_clap(clap)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog barks loudly\nsoft piano melody\nbirds sing at dawn\n")
    out = tmp_path / "run"
    args = ["train", "recipe=stable_audio_3_flowgrpo", f"model.path={model}", f"data.path={prompts}",
            f"reward.path={clap}", "reward.device=cpu", f"trainer.output_dir={out}", "trainer.max_steps=2",
            "trainer.eval_every=2", "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "model.dtype=float32",
            f"model.options.seconds={SECONDS}", "rollout.num_steps=3", "rollout.n=2", "rollout.batch_size=4",
            "data.prompts_per_step=2", "actor.num_minibatches=1", "actor.micro_batch_size=2", "actor.lora_rank=4",
            "actor.lora_alpha=4", "actor.lr=1e-3"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert math.isfinite(r["reward/mean"]) and r["grad_norm"] > 0
        assert r["ratio_absdev/first_minibatch"] < 1e-4
    waveform, rate = decode_wav((out / "samples" / "step_000002.wav").read_bytes(), max_seconds=10)
    clip = int(SECONDS * RATE)
    assert rate == RATE and waveform.shape == (2, 2 * clip + int(GAP_SECONDS * RATE))
    with Image.open(out / "samples" / "step_000002.png") as png:
        assert png.width == 2 * 2 * 128
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for k, t in state.items() if "lora_B" in k)
