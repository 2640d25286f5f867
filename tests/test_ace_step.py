"""The ACE-Step 1.5 adapter against diffusers' own AceStepPipeline (text2music) on a tiny random checkpoint the test
builds and saves: the condition sequence, the velocity at every step of an unguided run, APG guidance (equal to the
pipeline's at every step once its momentum is 0, and at the first step with its momentum), the σ grid, decode with
the pipeline's peak normalisation; prompts of different lengths in one batch; the analytic FLOP count against the
executed operations; and a 2-step CLI run of the recipe with `reward=clap` that writes a wav and a spectrogram PNG."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from flop_count import executed_flops

from polyrl.latents import MediaShape
from polyrl.models.ace_step import ACE_LORA_TARGETS, AceStepPolicy, ace_apg, ace_forward_flops, ace_peak_normalize
from polyrl.models.base import Guidance

WORDS = ("a dog barks loudly in the rain soft piano melody birds sing at dawn instruction caption metas fill audio "
         "semantic mask based on given conditions bpm timesignature keyscale duration seconds languages lyric en "
         "n a major c la").split()
PROMPT, OTHER = "a dog barks loudly in the rain", "soft piano"
RATE, HOP, CHANNELS = 4000, 32, 4  # the tiny VAE: 4 kHz, 32 samples per latent frame (125 frames/s), 4 channels
SECONDS = 0.3  # 38 latent frames


def build_tiny_ace(words: list[str] = WORDS, seed: int = 0):
    """A tiny AceStepPipeline with random weights: Qwen3 (hidden 16, 1 layer) text encoder, a condition encoder (1 lyric
    and 1 timbre layer) with a random silence latent, a 2-layer DiT (sliding + full attention, patch 2, 4 acoustic
    channels) and an Oobleck VAE (hop 32, stereo, 4 kHz), FlowMatchEuler with timesteps in [0, 1]."""
    from diffusers import (
        AceStepPipeline,
        AceStepTransformer1DModel,
        AutoencoderOobleck,
        FlowMatchEulerDiscreteScheduler,
    )
    from diffusers.pipelines.ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from polyrl.models.tiny import word_tokenizer

    tokenizer = word_tokenizer(words, 64, add_bos=False)
    torch.manual_seed(seed)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                          max_position_embeddings=256)).eval()
    condition = AceStepConditionEncoder(hidden_size=16, intermediate_size=32, text_hidden_dim=16,
                                        timbre_hidden_dim=CHANNELS, num_lyric_encoder_hidden_layers=1,
                                        num_timbre_encoder_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=8, sliding_window=4)
    with torch.no_grad():
        condition.silence_latent.normal_()  # the converter writes the VAE's latent of silence here
    transformer = AceStepTransformer1DModel(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                            in_channels=3 * CHANNELS, audio_acoustic_hidden_dim=CHANNELS, patch_size=2,
                                            sliding_window=4)
    vae = AutoencoderOobleck(encoder_hidden_size=2 * CHANNELS, downsampling_ratios=[4, 8], channel_multiples=[1, 2],
                             decoder_channels=4, decoder_input_channels=CHANNELS, audio_channels=2, sampling_rate=RATE)
    return AceStepPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                           condition_encoder=condition,
                           scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0))


def _cfg(path, shift=None, **options):
    return SimpleNamespace(name="ace_step", path=str(path), dtype="float32", max_sequence_length=256, compile="none",
                           fp8=False, shift=shift, options={"seconds": SECONDS, **options})


@pytest.fixture(scope="module")
def ace(tmp_path_factory):
    pipe = build_tiny_ace()
    path = tmp_path_factory.mktemp("ace")
    pipe.save_pretrained(str(path))
    return pipe, path, AceStepPolicy(_cfg(path), torch.device("cpu"))


def test_condition_sequence_equals_the_pipelines(ace):
    pipe, _, policy = ace
    with torch.no_grad():
        text, text_mask, lyric, lyric_mask = pipe.encode_prompt(PROMPT, "", "cpu", audio_duration=SECONDS)
        timbre = pipe.condition_encoder.silence_latent[:, : math.ceil(30 * RATE / HOP)]
        states, _ = pipe.condition_encoder(text, text_mask, lyric, lyric_mask, timbre, torch.zeros(1, dtype=torch.long))
    cond = policy.encode_prompts([PROMPT, OTHER])
    length = int(cond["context_len"][0])
    assert length == states.shape[1] and int(cond["context_len"][1]) < length
    torch.testing.assert_close(cond["context"][0], states[0], rtol=0, atol=1e-6)
    assert cond["context"][1, int(cond["context_len"][1]) :].abs().sum() == 0  # zero padding, never attended


def _record_run(pipe, guidance: float, steps: int = 4, prompt: str = PROMPT, **kw):
    scheduler, records = pipe.scheduler, []
    step = scheduler.step

    def recording_step(model_output, timestep, sample, **kws):
        records.append((model_output.clone(), float(timestep), sample.clone()))
        return step(model_output, timestep, sample, **kws)

    scheduler.step = recording_step
    try:
        out = pipe(prompt, audio_duration=SECONDS, num_inference_steps=steps, guidance_scale=guidance,
                   generator=torch.Generator().manual_seed(0), output_type="latent", **kw)
    finally:
        del scheduler.step
    return records, out.audios


def test_unguided_velocity_equals_the_pipeline_at_every_step(ace):
    pipe, _, policy = ace
    records, _ = _record_run(pipe, 1.0)
    sigmas = policy.sigmas(4)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=0, atol=0)  # the same float32 grid
    cond = policy.encode_prompts([PROMPT])
    for i, (velocity, t, x) in enumerate(records):
        assert t == float(sigmas[i])
        v = policy.velocity({"x": x}, sigmas[i : i + 1], cond, {}, 1.0)["x"]
        torch.testing.assert_close(v, velocity, rtol=0, atol=1e-6)


def test_apg_equals_the_pipelines_without_momentum_and_at_its_first_step(ace, monkeypatch):
    """With the pipeline's APG momentum set to 0 the guided velocity equals the adapter's at every step (inside and
    outside the CFG interval); with its momentum (−0.75) they agree at the first guided step only."""
    import diffusers.pipelines.ace_step.pipeline_ace_step as module

    pipe, path, policy = ace
    shared = policy.encode_guidance(Guidance(3.0))
    cond = policy.encode_prompts([PROMPT])
    original = module.MomentumBuffer
    monkeypatch.setattr(module, "MomentumBuffer", lambda momentum: original(0.0))
    records, _ = _record_run(pipe, 3.0, cfg_interval_start=0.2)
    interval = AceStepPolicy(_cfg(path, cfg_interval_start=0.2), torch.device("cpu"))
    sigmas = policy.sigmas(4)
    for i, (velocity, _, x) in enumerate(records):  # σ = 1, 0.9: 1 − σ < 0.2, unguided; then APG
        v = interval.velocity({"x": x}, sigmas[i : i + 1], cond, shared, 3.0)["x"]
        torch.testing.assert_close(v, velocity, rtol=0, atol=1e-5)
    xs = torch.cat([x for _, _, x in records])  # all four steps in one call: split by the interval inside
    batch = interval.velocity({"x": xs}, sigmas[:4], {k: v.expand(4, *v.shape[1:]) for k, v in cond.items()}, shared,
                              3.0)["x"]
    torch.testing.assert_close(batch, torch.cat([r[0] for r in records]), rtol=0, atol=1e-5)
    monkeypatch.setattr(module, "MomentumBuffer", original)
    records, _ = _record_run(pipe, 3.0)
    first = policy.velocity({"x": records[0][2]}, sigmas[:1], cond, shared, 3.0)["x"]
    torch.testing.assert_close(first, records[0][0], rtol=0, atol=1e-5)
    later = policy.velocity({"x": records[1][2]}, sigmas[1:2], cond, shared, 3.0)["x"]
    assert (later - records[1][0]).abs().max() > 1e-3  # the momentum the adapter leaves out


def test_apg_against_float64_formula():
    g = torch.Generator().manual_seed(0)
    c, u = torch.randn(2, 7, 3, generator=g), torch.randn(2, 7, 3, generator=g)
    for threshold in (2.5, 100.0):
        d = (c - u).double()
        d = d * torch.clamp(threshold / d.norm(dim=1, keepdim=True), max=1.0)
        unit = c.double() / c.double().norm(dim=1, keepdim=True)
        expected = c.double() + 2.0 * (d - (d * unit).sum(1, keepdim=True) * unit)
        torch.testing.assert_close(ace_apg(c, u, 3.0, threshold).double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(ace_apg(c, u, 1.0), c)  # scale 1: the conditional velocity


def test_prompts_of_different_lengths_in_one_batch(ace):
    """A batch mixing prompts of different condition lengths equals each prompt alone (no padding is attended)."""
    _, _, policy = ace
    x = torch.randn(2, *policy.latent_shapes(MediaShape())["x"], generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.5])
    both = policy.velocity({"x": x}, sigma, policy.encode_prompts([PROMPT, OTHER]), {}, 1.0)["x"]
    for i, prompt in enumerate([PROMPT, OTHER]):
        alone = policy.velocity({"x": x[i : i + 1]}, sigma[i : i + 1], policy.encode_prompts([prompt]), {}, 1.0)["x"]
        torch.testing.assert_close(both[i : i + 1], alone, rtol=0, atol=1e-6)


def test_decode_equals_the_pipelines_normalised_waveform(ace):
    pipe, _, policy = ace
    _, latents = _record_run(pipe, 1.0, steps=2)
    with torch.no_grad():
        audio = pipe.vae.decode(latents.transpose(1, 2)).sample.float()
    decoded = policy.decode({"x": latents})["audio"]
    assert decoded.sample_rate == RATE and decoded.waveform.shape == (1, 2, math.ceil(SECONDS * RATE / HOP) * HOP)
    torch.testing.assert_close(decoded.waveform, ace_peak_normalize(audio), rtol=0, atol=1e-6)
    assert decoded.waveform.abs().max() == pytest.approx(10 ** (-1 / 20), abs=1e-6)  # −1 dBFS peak
    loud = ace_peak_normalize(torch.tensor([[[0.5, -3.0, 1.5]]]))
    torch.testing.assert_close(loud, torch.tensor([[[0.5, -3.0, 1.5]]]) / 3.0 * 10 ** (-1 / 20))
    back = policy.encode_media({"audio": decoded})["x"]
    assert back.shape == latents.shape and torch.isfinite(back).all()


def test_grid_shift_options_and_errors(ace):
    _, path, policy = ace
    assert policy.latent_shapes(MediaShape()) == {"x": (math.ceil(SECONDS * RATE / HOP), CHANNELS)}
    u = torch.linspace(1, 0, 9)
    torch.testing.assert_close(AceStepPolicy(_cfg(path, shift=2.0), torch.device("cpu")).sigmas(8), 2 * u / (1 + u))
    torch.testing.assert_close(AceStepPolicy(_cfg(path, shift=1.0), torch.device("cpu")).sigmas(8), u)
    from polyrl.errors import UserError

    with pytest.raises(UserError, match="model.options.lyrics=3 is not valid"):
        AceStepPolicy(_cfg(path, lyrics=3), torch.device("cpu"))
    with pytest.raises(ValueError, match="set model.options.seconds=2"):
        policy.latent_shapes(MediaShape(seconds=2.0))
    policy.is_turbo = True
    try:
        with pytest.raises(UserError, match="turbo .*use rollout.guidance_scale=1.0"):
            policy.encode_guidance(Guidance(3.0))
    finally:
        policy.is_turbo = False


# ----------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("frames", [20, 21])  # 21: padded to the patch size
def test_ace_flops_match_executed_ops(frames):
    model = build_tiny_ace().transformer.eval()
    batch, context = 3, 9
    t = torch.rand(batch)
    inputs = dict(hidden_states=torch.randn(batch, frames, CHANNELS), timestep=t, timestep_r=t,
                  encoder_hidden_states=torch.randn(batch, context, 16),
                  context_latents=torch.randn(batch, frames, 2 * CHANNELS), return_dict=False)
    executed, attention_calls = executed_flops(model, inputs)
    assert attention_calls == 2 * model.config.num_hidden_layers
    assert ace_forward_flops(model.config, frames, context) * batch == pytest.approx(executed, rel=1e-12)


def test_lora_targets_are_every_layers_attention_and_mlp():
    model = build_tiny_ace().transformer
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in ACE_LORA_TARGETS:
        assert len([n for n in names if n.endswith("." + target)]) == model.config.num_hidden_layers, target


# ----------------------------------------------------------------------------------------------- the recipe, end to end
def test_recipe_trains_two_steps_and_writes_a_wav_and_a_spectrogram(tmp_path):
    from PIL import Image
    from safetensors.torch import load_file
    from test_clap import build_tiny_clap

    from polyrl.cli.main import main
    from polyrl.rewards.codec import decode_wav
    from polyrl.trainer.audio_samples import GAP_SECONDS

    model, clap = tmp_path / "ace", tmp_path / "clap"
    build_tiny_ace().save_pretrained(str(model))
    build_tiny_clap(clap)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog barks loudly\nsoft piano melody\nbirds sing at dawn\n")
    out = tmp_path / "run"
    args = ["train", "recipe=ace_step_flowgrpo", f"model.path={model}", f"data.path={prompts}",
            f"reward.path={clap}", "reward.device=cpu", f"trainer.output_dir={out}", "trainer.max_steps=2",
            "trainer.eval_every=2", "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "model.dtype=float32",
            f"model.options.seconds={SECONDS}", "rollout.num_steps=4", "rollout.n=2", "rollout.batch_size=4",
            "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]", "data.prompts_per_step=2",
            "actor.num_minibatches=1", "actor.micro_batch_size=2", "actor.lora_rank=4", "actor.lora_alpha=4",
            "actor.lr=1e-3"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert math.isfinite(r["reward/mean"]) and r["grad_norm"] > 0
        assert r["ratio_absdev/first_minibatch"] < 1e-4
    waveform, rate = decode_wav((out / "samples" / "step_000002.wav").read_bytes(), max_seconds=10)
    clip = math.ceil(SECONDS * RATE / HOP) * HOP
    assert rate == RATE and waveform.shape == (2, 2 * clip + int(GAP_SECONDS * RATE))
    with Image.open(out / "samples" / "step_000002.png") as png:
        assert png.width == 2 * 2 * 128
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for k, t in state.items() if "lora_B" in k)
