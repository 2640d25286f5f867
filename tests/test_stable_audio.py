"""The Stable Audio Open adapter against diffusers' own StableAudioPipeline on a tiny random checkpoint the test builds
and saves: the cross-attention context, the guided denoiser output at every step of a pipeline run (converted to
flow velocity in float64 from the pipeline's own v-prediction), decode; the EDM → flow change of variables against
float64 EDM formulas; the σ grid against the scheduler's; the analytic FLOP count against the executed operations;
and a 2-step CLI run of the recipe with `reward=clap` that writes a wav and a spectrogram PNG."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from flop_count import executed_flops

from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.models.stable_audio import (
    SAO_LORA_TARGETS,
    StableAudioOpenPolicy,
    edm_sigmas,
    flow_sigma,
    sao_flow_velocity,
    sao_forward_flops,
    sao_network_input,
    sao_sigmas,
    sao_timestep,
)

WORDS = "a dog barks loudly in the rain soft piano melody birds sing at dawn low quality noise".split()
PROMPT, NEGATIVE = "a dog barks loudly in the rain", "low quality noise"
RATE, HOP, WINDOW = 4000, 32, 64  # the tiny VAE: 4 kHz, 32 samples per latent frame, a 64-frame window (0.512 s)
SECONDS = 0.4


def build_tiny_sao(words: list[str] = WORDS, seed: int = 0):
    """A tiny StableAudioPipeline with random weights: T5 (d 16, 1 layer, 12 tokens) + projection to 24, a 2-block
    DiT (2 query heads, 1 key/value head of 8, 4 latent channels, a 64-frame window) and an Oobleck VAE (hop 32,
    stereo, 4 kHz), with Stable Audio Open's scheduler (CosineDPMSolverMultistepScheduler's defaults)."""
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
    )
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    from polyrl.models.tiny import word_tokenizer

    tokenizer = word_tokenizer(words, 12, add_bos=False)
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                           num_heads=2, relative_attention_num_buckets=8)).eval()
    projection = StableAudioProjectionModel(text_encoder_dim=16, conditioning_dim=24, min_value=0, max_value=32)
    transformer = StableAudioDiTModel(sample_size=WINDOW, in_channels=4, num_layers=2, attention_head_dim=8,
                                      num_attention_heads=2, num_key_value_attention_heads=1, out_channels=4,
                                      cross_attention_dim=16, time_proj_dim=16, global_states_input_dim=48,
                                      cross_attention_input_dim=24)
    vae = AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[4, 8], channel_multiples=[1, 2],
                             decoder_channels=4, decoder_input_channels=4, audio_channels=2, sampling_rate=RATE)
    return StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection, tokenizer=tokenizer,
                               transformer=transformer, scheduler=CosineDPMSolverMultistepScheduler())


def _cfg(path, **options):
    return SimpleNamespace(name="stable_audio", path=str(path), dtype="float32", max_sequence_length=12,
                           compile="none", fp8=False, options={"seconds": SECONDS, **options})


@pytest.fixture(scope="module")
def sao(tmp_path_factory):
    pipe = build_tiny_sao()
    path = tmp_path_factory.mktemp("sao")
    pipe.save_pretrained(str(path))
    return pipe, path, StableAudioOpenPolicy(_cfg(path), torch.device("cpu"))


def test_context_equals_the_pipelines_text_and_duration_embeddings(sao):
    pipe, _, policy = sao
    prompts = [PROMPT, NEGATIVE, " ".join(WORDS)]  # the last one is truncated to 12 tokens
    ours = policy.encode_prompts(prompts)["context"]
    with torch.no_grad():
        text = pipe.encode_prompt(prompts, "cpu", False)
        start, end = pipe.encode_duration(0.0, SECONDS, "cpu", False, 3)
    assert ours.shape == (3, 12 + 2, 24)
    torch.testing.assert_close(ours, torch.cat([text, start, end], 1), rtol=0, atol=1e-6)


def _record_run(pipe, guidance: float, negative: str | None, steps: int = 4):
    """Run the pipeline, recording (v-prediction, σ, latents) at every step. The scheduler's own DPM-Solver SDE step
    is replaced by a DDIM step (any update serves: each step is compared at its own inputs)."""
    from diffusers.schedulers.scheduling_utils import SchedulerOutput

    scheduler, records = pipe.scheduler, []

    def recording_step(model_output, timestep, sample, **kw):
        sigma, sigma_next = scheduler.sigmas[scheduler.step_index], scheduler.sigmas[scheduler.step_index + 1]
        records.append((model_output.clone(), float(sigma), timestep, sample.clone()))
        denoised = scheduler.precondition_outputs(sample, model_output, sigma)
        scheduler._step_index += 1
        return SchedulerOutput(prev_sample=denoised + sigma_next / sigma * (sample - denoised))

    scheduler.step = recording_step
    final = {}
    try:
        out = pipe(PROMPT, audio_end_in_s=SECONDS, num_inference_steps=steps, guidance_scale=guidance,
                   negative_prompt=negative, generator=torch.Generator().manual_seed(0),
                   callback=lambda i, t, latents: final.update(latents=latents))
    finally:
        del scheduler.step
    return records, final["latents"], out.audios


def reference_flow_velocity(x_sigma: torch.Tensor, v_pred: torch.Tensor, sigma: float) -> torch.Tensor:
    """float64 EDM (σ_data = 1): x̂0 = x/(σ²+1) − σ/√(σ²+1)·F, ε̂ = (x − x̂0)/σ; the flow velocity is ε̂ − x̂0."""
    x, f, s = x_sigma.double(), v_pred.double(), torch.tensor(sigma, dtype=torch.float64)
    x0 = x / (s**2 + 1) - s / torch.sqrt(s**2 + 1) * f
    return (x - x0) / s - x0


@pytest.mark.parametrize("negative", [None, NEGATIVE])
def test_velocity_equals_the_pipelines_guided_denoiser(sao, negative):
    """At every step of a CFG run (zeros as the unconditional, or a negative prompt) the adapter's velocity at the
    pipeline's latents, moved to flow coordinates y = x/(1 + σ), s = σ/(1 + σ), equals the pipeline's own guided
    v-prediction turned into ε̂ − x̂0 in float64; the network saw the same c_noise."""
    pipe, _, policy = sao
    records, _, _ = _record_run(pipe, 3.0, negative)
    cond = policy.encode_prompts([PROMPT])
    shared = policy.encode_guidance(Guidance(3.0, negative or ""))
    ys, ss, expected = [], [], []
    for v_pred, sigma, t, x in records:
        s = flow_sigma(torch.tensor([sigma], dtype=torch.float64)).float()
        assert float(sao_timestep(s)) == pytest.approx(float(t), abs=1e-6)  # atan(σ)·2/π
        y = (x.double() / (1 + sigma)).float()
        v = policy.velocity({"x": y}, s, cond, shared, 3.0)["x"]
        ref = reference_flow_velocity(x, v_pred, sigma)
        torch.testing.assert_close(v.double(), ref, rtol=0, atol=2e-5)
        ys.append(y), ss.append(s), expected.append(ref)
    batch = policy.velocity({"x": torch.cat(ys)}, torch.cat(ss), {"context": cond["context"].expand(4, -1, -1)},
                            shared, 3.0)["x"]
    torch.testing.assert_close(batch.double(), torch.cat(expected), rtol=0, atol=2e-5)
    if negative is None:
        assert shared["context"].abs().sum() == 0  # the pipeline's zero unconditional


def test_unguided_velocity_and_decode_equal_the_pipeline(sao):
    pipe, _, policy = sao
    records, final, audio = _record_run(pipe, 1.0, None, steps=3)
    cond = policy.encode_prompts([PROMPT])
    for v_pred, sigma, _, x in records:
        s = flow_sigma(torch.tensor([sigma], dtype=torch.float64)).float()
        v = policy.velocity({"x": (x.double() / (1 + sigma)).float()}, s, cond, {}, 1.0)["x"]
        torch.testing.assert_close(v.double(), reference_flow_velocity(x, v_pred, sigma), rtol=0, atol=2e-5)
    decoded = policy.decode({"x": final})["audio"]
    assert decoded.sample_rate == RATE and decoded.waveform.shape == (1, 2, int(SECONDS * RATE))
    torch.testing.assert_close(decoded.waveform, audio.clamp(-1, 1), rtol=0, atol=1e-6)
    latents = policy.encode_media({"audio": decoded})["x"]  # back through the encoder's posterior mean
    assert latents.shape == (1, 4, WINDOW) and torch.isfinite(latents).all()


def test_change_of_variables_against_float64_edm():
    """`sao_network_input`, `sao_timestep`, `sao_flow_velocity` against EDM's c_in, c_noise, c_skip, c_out written
    out in float64 for several σ_data, and the σ → ∞ limit (s = 1)."""
    g = torch.Generator().manual_seed(0)
    y, f = torch.randn(5, 3, 7, generator=g, dtype=torch.float64), torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    sigma = torch.tensor([0.05, 0.3, 1.0, 17.0, 500.0], dtype=torch.float64)
    for sd in (1.0, 0.5):
        s = sigma / (1 + sigma)
        x = y * (1 + sigma).view(-1, 1, 1)  # x_σ = y·(1 + σ)
        c_in = 1 / torch.sqrt(sigma**2 + sd**2)
        x0 = (sd**2 / (sigma**2 + sd**2)).view(-1, 1, 1) * x - (sigma * sd / torch.sqrt(sigma**2 + sd**2)).view(-1, 1, 1) * f
        torch.testing.assert_close(sao_network_input(y, s, sd), c_in.view(-1, 1, 1) * x, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sao_flow_velocity(y, f, s, sd), (y - x0) / s.view(-1, 1, 1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sao_timestep(s), torch.atan(sigma) * 2 / math.pi, rtol=1e-12, atol=1e-12)
    one = torch.ones(1, dtype=torch.float64)  # σ = ∞: x_σ/√(σ²+1) → ε = y, x̂0 = −F, v = ε − x̂0 = y + F
    torch.testing.assert_close(sao_network_input(y[:1], one), y[:1])
    torch.testing.assert_close(sao_flow_velocity(y[:1], f[:1], one), y[:1] + f[:1])
    assert float(sao_timestep(one)) == 1.0
    # an Euler step of the flow ODE to s' = 0 lands on the denoised sample x̂0 (cps/ode steps read x̂0 = y − s·v)
    s = torch.tensor([0.3], dtype=torch.float64)
    x0 = y[:1] * (1 + 3 / 7) / (1 + (3 / 7) ** 2) - (3 / 7) / math.sqrt(1 + (3 / 7) ** 2) * f[:1]
    torch.testing.assert_close(y[:1] - s * sao_flow_velocity(y[:1], f[:1], s), x0, rtol=1e-10, atol=1e-10)


def test_sigma_grid_is_the_schedulers_mapped_to_flow_levels(sao):
    _, _, policy = sao
    from diffusers import CosineDPMSolverMultistepScheduler

    for steps in (1, 4, 25):
        scheduler = CosineDPMSolverMultistepScheduler()
        scheduler.set_timesteps(steps)
        grid = policy.sigmas(steps)
        assert grid.dtype == torch.float32 and grid.shape == (steps + 1,)
        assert grid[0] == 1.0 and grid[-1] == 0.0 and bool((grid[1:] < grid[:-1]).all())
        expected = scheduler.sigmas.double() / (1 + scheduler.sigmas.double())
        torch.testing.assert_close(grid[1:].double(), expected[1:], rtol=1e-6, atol=1e-7)
    karras = CosineDPMSolverMultistepScheduler(sigma_schedule="karras")._compute_karras_sigmas(torch.linspace(0, 1, 5))
    torch.testing.assert_close(edm_sigmas(5, 0.3, 500.0, "karras"), karras)
    assert sao_sigmas(3, 0.3, 500.0)[-2] == pytest.approx(0.3 / 1.3)  # σ_min is the last level before 0


def test_latent_shapes_options_and_errors(sao, tmp_path):
    _, path, policy = sao
    assert policy.latent_shapes(MediaShape(height=512, width=512)) == {"x": (4, WINDOW)}  # the whole window
    with pytest.raises(ValueError, match="set model.options.seconds=0.2"):
        policy.latent_shapes(MediaShape(seconds=0.2))
    from polyrl.errors import UserError

    with pytest.raises(UserError, match=r"model.options.seconds=2 must be in \(0, 0.512\]"):
        StableAudioOpenPolicy(_cfg(path, seconds=2.0), torch.device("cpu"))
    with pytest.raises(UserError, match="model.options.seconds='long' is not valid"):
        StableAudioOpenPolicy(_cfg(path, seconds="long"), torch.device("cpu"))
    whole = StableAudioOpenPolicy(_cfg(path, seconds=None), torch.device("cpu"))
    assert whole.seconds == pytest.approx(WINDOW * HOP / RATE)
    bad = tmp_path / "edm"
    bad.mkdir()
    for item in path.iterdir():
        (bad / item.name).symlink_to(item)
    (bad / "scheduler").unlink()
    (bad / "scheduler").mkdir()
    (bad / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "EDMDPMSolverMultistepScheduler"}))
    with pytest.raises(UserError, match="reproduces CosineDPMSolverMultistepScheduler with v_prediction"):
        StableAudioOpenPolicy(_cfg(bad), torch.device("cpu"))


# ----------------------------------------------------------------------------------------------- FLOPs
def test_sao_flops_match_executed_ops():
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    model = build_tiny_sao().transformer.eval()
    batch, frames, context = 3, 20, 9
    inputs = dict(hidden_states=torch.randn(batch, 4, frames), timestep=torch.rand(batch),
                  encoder_hidden_states=torch.randn(batch, context, 24), global_hidden_states=torch.randn(batch, 1, 48),
                  rotary_embedding=get_1d_rotary_pos_embed(4, frames + 1, use_real=True, repeat_interleave_real=False),
                  return_dict=False)
    executed, attention_calls = executed_flops(model, inputs)
    assert attention_calls == 2 * model.config.num_layers
    assert sao_forward_flops(model.config, frames, context) * batch == pytest.approx(executed, rel=1e-12)


def test_adapter_counts_both_cfg_forwards(sao):
    _, _, policy = sao
    cond = policy.encode_prompts([PROMPT, PROMPT])
    shared = policy.encode_guidance(Guidance(3.0, ""))
    before = policy.flops
    with torch.no_grad():
        policy.velocity({"x": torch.zeros(2, 4, WINDOW)}, torch.tensor([0.5, 0.9]), cond, shared, 3.0)
    assert policy.flops - before == pytest.approx(2 * 2 * sao_forward_flops(policy.transformer.config, WINDOW, 14))


def test_lora_targets_are_every_blocks_attention_and_feed_forward():
    model = build_tiny_sao().transformer
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in SAO_LORA_TARGETS:
        assert len([n for n in names if n.endswith("." + target)]) == model.config.num_layers, target


# ----------------------------------------------------------------------------------------------- the recipe, end to end
def test_recipe_trains_two_steps_and_writes_a_wav_and_a_spectrogram(tmp_path):
    """`polyrl train recipe=stable_audio_flowgrpo reward=clap` on the tiny checkpoint and a tiny CLAP: two steps,
    finite rewards and gradients, rollout and training agree on the log-prob, the LoRA receives gradients, and the
    sample grid is a wav (the tiles one after another) plus a spectrogram PNG."""
    from PIL import Image
    from safetensors.torch import load_file
    from test_clap import build_tiny_clap

    from polyrl.cli.main import main
    from polyrl.rewards.codec import decode_wav
    from polyrl.trainer.audio_samples import GAP_SECONDS

    model, clap = tmp_path / "sao", tmp_path / "clap"
    build_tiny_sao().save_pretrained(str(model))
    build_tiny_clap(clap)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog barks loudly\nsoft piano melody\nbirds sing at dawn\n")
    out = tmp_path / "run"
    args = ["train", "recipe=stable_audio_flowgrpo", f"model.path={model}", f"data.path={prompts}",
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
        assert math.isfinite(r["reward/mean"]) and -1 <= r["reward/mean"] <= 1 and r["grad_norm"] > 0
        assert r["ratio_absdev/first_minibatch"] < 1e-4  # the actor re-scores the rollout's log-prob
    waveform, rate = decode_wav((out / "samples" / "step_000002.wav").read_bytes(), max_seconds=10)
    clip = int(SECONDS * RATE)
    assert rate == RATE and waveform.shape == (2, 2 * clip + int(GAP_SECONDS * RATE))
    assert abs(waveform[:, clip : clip + int(GAP_SECONDS * RATE)]).max() == 0 and abs(waveform[:, :clip]).max() > 0
    with Image.open(out / "samples" / "step_000002.png") as png:
        assert png.width == 2 * 2 * 128 and png.height > 2 * 64  # two 2×-scaled spectrogram tiles plus captions
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    lora_b = [t for k, t in state.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at 0: only a gradient moves it


def test_spectrogram_tiles_put_low_frequencies_at_the_bottom():
    from polyrl.trainer.audio_samples import TILE_HEIGHT, TILE_WIDTH, spectrogram_images, tiles_waveform

    t = torch.arange(RATE) / RATE
    clips = torch.stack([torch.sin(2 * math.pi * 100 * t), torch.sin(2 * math.pi * 1500 * t)])[:, None]  # (2, 1, N)
    images = spectrogram_images(clips, RATE)
    assert images.shape == (2, 3, TILE_HEIGHT, TILE_WIDTH) and images.min() >= 0 and images.max() <= 1
    brightest = images.sum(1).mean(-1).argmax(-1)  # the brightest row of each tile (row 0 = the top)
    assert brightest[0] >= 0.9 * TILE_HEIGHT  # 100 Hz of a 2 kHz range: the bottom twentieth
    assert 0.15 * TILE_HEIGHT <= brightest[1] <= 0.35 * TILE_HEIGHT  # 1500 Hz: a quarter from the top
    joined = tiles_waveform(clips, RATE)
    assert joined.shape == (1, 2 * RATE + RATE // 2) and joined[:, RATE : RATE + RATE // 2].abs().max() == 0
