"""The MiniMax-H3 adapter against diffusers' own modular pipeline on a tiny random checkpoint the test builds and saves
(tests/minimax_h3_tiny.py), in its three modes: the velocity of the generated rows equals the pipeline's denoiser
(negated: data-ward → noise-ward) at every step of its schedule, for a batch that mixes σ values; the σ grids of
both streams; decode to frames + stereo waveform; and 2-step CLI runs that train and write an mp4 with sound."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from minimax_h3_tiny import install_processor_shim, save_tiny

from polyrl.latents import MediaShape
from polyrl.models.minimax_h3 import MiniMaxH3Policy, reshift

install_processor_shim()

FRAMES, HEIGHT, WIDTH = 124, 32, 64  # the pipeline's shortest video (5.17 s at 24 fps): 37 latent frames of 2×4
SHAPE = MediaShape(height=HEIGHT, width=WIDTH, frames=FRAMES, fps=24.0)
STEPS = 3


def gradient_image(path, w, h, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), np.full_like(xx, rng.integers(0, 255))], -1)
    Image.fromarray(img.astype(np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmh3")
    path = root / "model"
    save_tiny(str(path))
    images = [gradient_image(root / f"k{i}.png", 96, 54, i) for i in range(2)]
    return path, images


def _cfg(path, **options):
    return SimpleNamespace(path=str(path), dtype="float32",
                           options={"num_frames": FRAMES, "height": HEIGHT, "width": WIDTH, **options})


PROMPTS = {"t2va": lambda im: "a cat plays the piano",
           "fl2va": lambda im: {"text": "a sunrise over the sea", "images": im},
           "ref2va": lambda im: {"text": "<Picture 1> sings a song", "images": im[:1]}}


def pipeline_denoiser_velocity(policy, state, step):
    """The pipeline's own denoiser block at `step` (its row timesteps and layout), on the generated rows."""
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep, MiniMaxH3Ref2VADenoiseStep

    loop = MiniMaxH3Ref2VADenoiseStep() if policy.mode == "ref2va" else MiniMaxH3DenoiseStep()
    block_state = loop.get_block_state(state)
    _, block_state = loop.sub_blocks["denoiser"](policy.pipe, block_state, i=step, t=state.get("timesteps")[step])
    nv, na = state.get("num_condition_video_rows"), state.get("num_condition_audio_rows")
    return block_state.noise_pred[0, nv:], block_state.audio_noise_pred[0, na:]


@pytest.mark.parametrize("mode", ["t2va", "fl2va", "ref2va"])
def test_velocity_equals_the_pipelines_denoiser(tiny, mode):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    path, images = tiny
    policy = MiniMaxH3Policy(_cfg(path, mode=mode), torch.device("cpu"))
    prompt = PROMPTS[mode](images)
    state = policy.prepare(prompt)
    policy.pipe.scheduler.set_timesteps(STEPS + 1)
    policy.pipe.audio_scheduler.set_timesteps(STEPS + 1)
    # the pipeline's 4-point grids = polyrl's 3-step grid (video) and its per-stream map (audio)
    sigmas = policy.sigmas(STEPS, SHAPE)
    assert torch.equal(sigmas, policy.pipe.scheduler.sigmas.float())
    assert torch.allclose(policy.stream_sigmas(sigmas)["audio"], policy.pipe.audio_scheduler.sigmas.float(), atol=1e-7)
    state.set("row_timestep_plan", [policy.pre.blocks.sub_blocks["denoise.set_timesteps"].build_row_timesteps(
        state.get("video_indices"), state.get("audio_indices"), state.get("num_condition_video_rows"),
        state.get("num_condition_audio_rows"), state.get("text_indices").numel(), float(t), float(ta),
        max(float(t), policy.noise_aug), 1.0) for t, ta in zip(policy.pipe.scheduler.timesteps,
                                                                 policy.pipe.audio_scheduler.timesteps, strict=True)])
    state.set("timesteps", policy.pipe.scheduler.timesteps)
    shapes = policy.latent_shapes(SHAPE)
    g = torch.Generator().manual_seed(1)
    x = {k: torch.randn((2, *s), generator=g) for k, s in shapes.items()}
    cond = policy.encode_prompts([prompt, prompt])
    nv, na = state.get("num_condition_video_rows"), state.get("num_condition_audio_rows")
    assert (nv > 0) == (mode != "t2va")
    with torch.no_grad():
        # one batch whose samples sit at different steps: the adapter groups them into one call per σ
        v = policy.velocity(x, torch.stack([sigmas[0], sigmas[1]]), cond, {}, 1.0)
        for b, step in ((0, 0), (1, 1)):
            rows = patchify_video_latents(x["video"][b:b + 1], policy.patch)
            state.set("latents", torch.cat([state.get("latents")[:nv], rows]))
            state.set("audio_latents", torch.cat([state.get("audio_latents")[:na], x["audio"][b]]))
            ref_video, ref_audio = pipeline_denoiser_velocity(policy, state, step)
            ours = patchify_video_latents(v["video"][b:b + 1], policy.patch)
            torch.testing.assert_close(ours, -ref_video, atol=2e-5, rtol=0)
            torch.testing.assert_close(v["audio"][b], -ref_audio, atol=2e-5, rtol=0)


def test_reshift_maps_one_grid_onto_the_other():
    from diffusers import MiniMaxH3Scheduler

    video, audio = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(21)
    audio.set_timesteps(21)
    base = torch.linspace(1, 0, 21, dtype=torch.float64)
    want = 3 * base / (1 + 2 * base)  # float64 reference of the audio grid
    assert torch.allclose(reshift(video.sigmas.double(), 12.0, 3.0), want, atol=1e-6)
    assert torch.allclose(reshift(video.sigmas, 12.0, 3.0), audio.sigmas, atol=1e-6)
    assert torch.equal(reshift(torch.tensor([1.0, 0.0]), 12.0, 3.0), torch.tensor([1.0, 0.0]))


def test_decode_equals_the_pipelines_frames_and_waveform(tiny):
    path, _ = tiny
    policy = MiniMaxH3Policy(_cfg(path), torch.device("cpu"))
    shapes = policy.latent_shapes(SHAPE)
    g = torch.Generator().manual_seed(2)
    x = {k: torch.randn((2, *s), generator=g) for k, s in shapes.items()}
    media = policy.decode(x)
    video, audio = media["video"], media["audio"]
    assert video.shape == (2, FRAMES, 3, HEIGHT, WIDTH) and 0 <= video.min() and video.max() <= 1
    assert audio.waveform.shape[:2] == (2, 2) and audio.sample_rate == 32000
    # the pipeline's own decode blocks on sample 1
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep, MiniMaxH3VideoDecodeStep

    state = PipelineState()
    state.set("latents", x["video"][1:2])
    state.set("audio_latents", x["audio"][1].view(2, -1, x["audio"].shape[-1]).permute(0, 2, 1))
    state.set("output_type", "pt")
    _, state = MiniMaxH3VideoDecodeStep()(policy.pipe, state)
    _, state = MiniMaxH3AudioDecodeStep()(policy.pipe, state)
    torch.testing.assert_close(video[1], state.get("videos")[0].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(audio.waveform[1], state.get("audio")[0].clamp(-1, 1), atol=1e-6, rtol=0)


def test_shape_mode_and_guidance_errors(tiny):
    from polyrl.errors import UserError
    from polyrl.models.base import Guidance

    path, images = tiny
    with pytest.raises(UserError, match="model.options.mode='x2va'; allowed: t2va, fl2va, ref2va"):
        MiniMaxH3Policy(_cfg(path, mode="x2va"), torch.device("cpu"))
    policy = MiniMaxH3Policy(_cfg(path), torch.device("cpu"))
    short = MiniMaxH3Policy(_cfg(path, num_frames=100), torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 17n \\+ 5 frames between 120 and 360"):
        short.latent_shapes(MediaShape(height=HEIGHT, width=WIDTH, frames=100, fps=24.0))
    with pytest.raises(ValueError, match="differs from model.options"):
        policy.latent_shapes(MediaShape(height=HEIGHT, width=2 * WIDTH, frames=FRAMES, fps=24.0))
    with pytest.raises(UserError, match="guidance-distilled"):
        policy.encode_guidance(Guidance(scale=4.0))
    with pytest.raises(UserError, match="t2va takes text only"):
        policy.encode_prompts([{"text": "x", "images": images[:1]}])
    assert MiniMaxH3Policy.condition_images({"mode": "fl2va"}) and not MiniMaxH3Policy.condition_images({})


@pytest.mark.parametrize("mode", ["t2va", "fl2va", "ref2va"])
def test_recipe_trains_two_steps_and_writes_an_mp4_with_sound(tiny, tmp_path, mode):
    """`polyrl train recipe=minimax_h3_flowgrpo` on the tiny checkpoint: two steps with finite rewards and gradients,
    rollout and training agree on the joint log-prob (each stream on its own σ), LoRA B moves, and the sample grid
    mp4 carries one sound track per tile."""
    import av
    from safetensors.torch import load_file

    from polyrl.cli.main import main

    path, images = tiny
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "a red ball rolls"}, {"prompt": "a blue sky at dawn"}]
    if mode == "fl2va":  # first and last keyframes
        rows = [{**r, "image": images} for r in rows]
    if mode == "ref2va":  # one reference image, named in the prompt
        rows = [{"prompt": "<Picture 1> " + r["prompt"], "image": images[i % 2]} for i, r in enumerate(rows)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["train", "recipe=minimax_h3_flowgrpo", f"model.path={path}", f"data.path={data}",
            f"model.options.mode={mode}", f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=2",
            "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=2", "trainer.progress=false",
            "trainer.tensorboard=false", "model.dtype=float32", f"rollout.height={HEIGHT}", f"rollout.width={WIDTH}",
            f"rollout.num_frames={FRAMES}", "rollout.num_steps=3", "rollout.n=2", "rollout.batch_size=2",
            "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", "data.prompts_per_step=2",
            "actor.num_minibatches=1", "actor.micro_batch_size=2", "actor.lora_rank=4", "actor.lora_alpha=4",
            "actor.lr=1e-3", "reward.frames=2", "algorithm.kl_beta=0.01"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for r in metrics[1:]:
        assert math.isfinite(r["reward/mean"]) and r["grad_norm"] > 0 and r["train/samples"] == 4
        assert r["ratio_absdev/first_minibatch"] < 1e-4
        assert math.isfinite(r["kl"])
    with av.open(str(out / "samples" / "step_000002.mp4")) as container:
        kinds = [s.type for s in container.streams]
        assert kinds.count("video") == 1 and kinds.count("audio") == 2
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    lora_b = [t for k, t in state.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)
