"""Wan image-to-video (`model=wan_i2v`, polyrl/models/wan_i2v.py) against diffusers' own WanImageToVideoPipeline, on
tiny random checkpoints the test builds: Wan2.2-TI2V-5B's first-frame layout (expand_timesteps: the condition image
is latent frame 0, timestep 0 on its tokens) and Wan2.2-I2V-A14B's channel-concat layout (two experts, 36 input
channels). Plus: the condition frame is exactly the encoded image and is not part of the sampled state (no
log-prob term); a 2-step CLI run; the one-line errors for a missing or unreadable image."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.latents import MediaShape
from polyrl.models.base import Guidance
from polyrl.models.tiny import TinyWanSpec, build_tiny_wan, save_tiny_wan
from polyrl.models.wan import wan_forward_flops
from polyrl.models.wan_i2v import WanI2VPolicy
from polyrl.sampling.diffusion import SamplingPlan, draw_noise, rollout
from polyrl.sampling.steps import sde_std

WORDS = "a red cat jumps over the blue dog slowly in rain bright overexposed static blurred".split()
PROMPT, NEGATIVE = "a red cat jumps over the blue dog", "static blurred"
MAX_LEN = 16
LAYOUTS = {  # name -> (spec kwargs, video size (frames, height, width))
    "ti2v": (dict(layout="wan2.2-ti2v"), (9, 64, 32)),  # 3 latent frames: the condition + 2 sampled
    "i2v-a14b": (dict(layout="wan2.1", boundary_ratio=0.9), (9, 32, 48)),  # 36-channel experts switched at t = 900
}


def _cfg(path, video, **kw):
    frames, height, width = video
    return SimpleNamespace(name="wan_i2v", path=str(path), dtype="float32", max_sequence_length=MAX_LEN,
                           compile="none", fp8=False, shift=None,
                           options={"num_frames": frames, "height": height, "width": width}, **kw)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two random RGB condition images of other sizes than the videos (the adapter resizes them)."""
    root = tmp_path_factory.mktemp("i2v_images")
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (40, 56), "b.png": (72, 24)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
    return root


@pytest.fixture(scope="module", params=list(LAYOUTS))
def i2v(request, tmp_path_factory):
    """(layout name, in-memory WanImageToVideoPipeline, the adapter loaded from its save_pretrained directory)."""
    spec_kw, video = LAYOUTS[request.param]
    pipe = build_tiny_wan(TinyWanSpec(words=WORDS, image_to_video=True, **spec_kw), seed=1)
    path = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    pipe.save_pretrained(str(path))
    return request.param, pipe, WanI2VPolicy(_cfg(path, video), torch.device("cpu"))


def _prompt(images, name="a.png", text=PROMPT):
    return {"text": text, "images": [str(images / name)]}


def test_velocity_condition_and_decode_equal_the_pipeline(i2v, images, monkeypatch):
    """Run WanImageToVideoPipeline (FlowMatchEuler with the checkpoint's shift) and record the guided noise prediction
    it hands the scheduler at every step; the adapter's batched-CFG velocity on the same latents and σ equals it (for
    TI2V on the sampled frames 1.., frame 0 being the condition). The condition latents equal the pipeline's
    `prepare_latents`, and decoding the last latents (TI2V: through `complete_latents`) equals the pipeline's video."""
    name, pipe, policy = i2v
    frames, height, width = LAYOUTS[name][1]
    # the I2V pipeline's prompt cleaning calls ftfy unconditionally (WanPipeline's, which the adapter uses, only when
    # it is installed; it is not a dependency): the same cleaning for both where ftfy is absent
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    ti2v = name == "ti2v"
    assert policy.expand_timesteps == ti2v and len(policy.modules()) == (1 if ti2v else 2)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=policy.shift)
    scale, recorded, step = 5.0, [], pipe.scheduler.step

    def recording_step(model_output, timestep, sample, **kw):
        recorded.append((model_output.clone(), timestep, sample.clone()))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = recording_step
    last = {}
    image = Image.open(images / "a.png").convert("RGB")
    out = pipe(image, PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=frames,
               num_inference_steps=4, guidance_scale=scale, generator=torch.Generator().manual_seed(0),
               output_type="pt", max_sequence_length=MAX_LEN,
               callback_on_step_end=lambda p, i, t, kw: last.update(kw) or {})
    cond = policy.encode_prompts([_prompt(images)])
    shared = policy.encode_guidance(Guidance(scale, NEGATIVE))
    assert set(shared) == {"prompt_embeds"}  # the negative branch is text only: the image stays the sample's
    # the condition: the pipeline's own preprocessing, VAE encode (mode) and normalisation, bit for bit
    pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
    theirs = pipe.prepare_latents(pixels, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32,
                                  torch.device("cpu"), torch.Generator().manual_seed(0))
    if ti2v:
        assert torch.equal(cond["condition"], theirs[1]) and cond["condition"].shape[2] == 1
    else:
        mask, latent = theirs[1][:, :4], theirs[1][:, 4:]
        assert torch.equal(cond["condition"], latent) and cond["condition"].shape[1] == 16
        assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()  # the mask the adapter builds
    sigmas, xs, sigs, want = pipe.scheduler.sigmas, [], [], []
    for i, (noise_pred, t, sample) in enumerate(recorded):
        sigma = sigmas[i : i + 1]
        assert torch.equal(sigma * 1000, t.reshape(1))
        x, expected = (sample[:, :, 1:], noise_pred[:, :, 1:]) if ti2v else (sample, noise_pred)
        v = policy.velocity({"x": x}, sigma, cond, shared, scale)["x"]
        torch.testing.assert_close(v, expected, rtol=0, atol=1e-5)
        xs.append(x), sigs.append(sigma), want.append(expected)
    if not ti2v:
        assert any(policy.high_noise(s) for s in sigs) and not all(policy.high_noise(s) for s in sigs)
    batched = {k: v.expand(4, *v.shape[1:]) for k, v in cond.items()}  # every step in one call (A14B: split by expert)
    v = policy.velocity({"x": torch.cat(xs)}, torch.cat(sigs), batched, shared, scale)["x"]
    torch.testing.assert_close(v, torch.cat(want), rtol=0, atol=1e-5)
    final = last["latents"][:, :, 1:] if ti2v else last["latents"]
    video = policy.decode(policy.complete_latents({"x": final}, cond))["video"]
    assert video.shape == (1, frames, 3, height, width)
    torch.testing.assert_close(video, out.frames, rtol=0, atol=1e-6)


def test_unconditional_branch_keeps_the_image(i2v, images):
    """Guided v = v_u + s·(v_c − v_u), v_u from the negative text *and the sample's own image*; the image moves v_u."""
    name, _, policy = i2v
    shape = policy.latent_shapes(MediaShape(*LAYOUTS[name][1][1:], frames=LAYOUTS[name][1][0]))["x"]
    x = {"x": torch.randn(2, *shape, generator=torch.Generator().manual_seed(2))}
    sigma = torch.tensor([0.95, 0.95])  # one expert for both samples
    cond = policy.encode_prompts([_prompt(images, "a.png"), _prompt(images, "b.png")])
    shared = policy.encode_guidance(Guidance(4.0, NEGATIVE))
    negative = {**cond, "prompt_embeds": shared["prompt_embeds"].expand(2, -1, -1)}
    v_c, v_u = policy.velocity(x, sigma, cond, {}, 1.0)["x"], policy.velocity(x, sigma, negative, {}, 1.0)["x"]
    torch.testing.assert_close(policy.velocity(x, sigma, cond, shared, 4.0)["x"], v_u + 4.0 * (v_c - v_u),
                               rtol=0, atol=1e-5)
    swapped = {**negative, "condition": negative["condition"].flip(0)}
    assert not torch.allclose(policy.velocity(x, sigma, swapped, {}, 1.0)["x"], v_u, atol=1e-4)


def test_ti2v_condition_frame_is_the_encoded_image_and_not_sampled(tmp_path, images):
    """A rollout (SDE on every step, CFG) of two samples per image: the sampled state holds the generated latent
    frames only, the latents handed to decode carry exactly the encoded image as frame 0, every sample of one image
    decodes to the same first video frame, and each step's log-prob is the Gaussian log-density over the generated
    elements alone (the condition frame adds no term and does not enter the per-element mean)."""
    spec_kw, video = LAYOUTS["ti2v"]
    path = save_tiny_wan(TinyWanSpec(words=WORDS, image_to_video=True, **spec_kw), tmp_path / "ti2v", seed=3)
    policy = WanI2VPolicy(_cfg(path, video), torch.device("cpu"))
    frames, height, width = video
    plan = SamplingPlan(num_steps=3, shape=MediaShape(height, width, frames=frames), guidance=Guidance(4.0, NEGATIVE),
                        noise_level=0.7, batch_size=2)
    shapes = policy.latent_shapes(plan.shape)
    assert shapes == {"x": (48, 2, height // 16, width // 16)}  # 3 latent frames, the first one the condition's
    prompts = [_prompt(images, "a.png"), _prompt(images, "a.png"), _prompt(images, "b.png"), _prompt(images, "b.png")]
    groups = torch.tensor([0, 0, 1, 1])
    noise = draw_noise(shapes, plan, groups, torch.Generator().manual_seed(0))
    batch = rollout(policy, prompts, [{}] * 4, groups, plan, noise)
    assert batch.latents["x"].shape == (4, 4, *shapes["x"]) and batch.final["x"].shape == (4, *shapes["x"])
    complete = policy.complete_latents(batch.final, batch.cond)["x"]
    for i, name in enumerate(["a.png", "a.png", "b.png", "b.png"]):
        assert torch.equal(complete[i, :, :1], policy.encode_condition(str(images / name)))
    assert torch.equal(complete[:, :, 1:], batch.final["x"])
    clip = batch.media["video"]
    torch.testing.assert_close(clip, policy.decode({"x": complete})["video"], rtol=0, atol=0)
    assert torch.equal(clip[0, 0], clip[1, 0]) and torch.equal(clip[2, 0], clip[3, 0])  # the image's frame
    assert not torch.equal(clip[0, -1], clip[1, -1])  # the generated frames differ
    # the log-probs by hand in float64 from the stored transitions: generated elements only
    sigmas = policy.sigmas(3, plan.shape).double()
    states, means = batch.latents["x"].double(), batch.old_means["x"].double()
    for j in range(3):
        level = torch.tensor(0.7, dtype=torch.float64)
        std = sde_std(sigmas[j], level, float(sigmas[1])) * torch.sqrt(sigmas[j] - sigmas[j + 1])
        terms = -((states[:, j + 1] - means[:, j]) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(batch.log_probs[:, j].double(), terms.flatten(1).mean(1), rtol=0, atol=1e-5)
        # had the fixed frame been kept in the state with a zero residual, its terms would shift the mean:
        with_frame = torch.cat([(-torch.log(std) - 0.5 * math.log(2 * math.pi)).expand_as(terms[:, :, :1]), terms], 2)
        assert (with_frame.flatten(1).mean(1) - batch.log_probs[:, j].double()).abs().min() > 1e-3
    # the forward FLOPs count the condition frame's tokens (they run through the network)
    before = policy.flops
    with torch.no_grad():
        policy.velocity({"x": batch.final["x"][:1]}, torch.tensor([0.5]), {k: v[:1] for k, v in batch.cond.items()},
                        {}, 1.0)
    tokens = 3 * (height // 32) * (width // 32)
    assert policy.flops - before == pytest.approx(wan_forward_flops(policy.transformer.config, tokens, MAX_LEN, True))


def test_layout_and_checkpoint_errors(tmp_path, tiny_wan_dir, images):
    spec_kw, video = LAYOUTS["ti2v"]
    path = save_tiny_wan(TinyWanSpec(words=WORDS, image_to_video=True, **spec_kw), tmp_path / "ti2v")
    policy = WanI2VPolicy(_cfg(path, (5, 64, 32)), torch.device("cpu"))
    assert policy.latent_shapes(MediaShape(64, 32, frames=5))["x"][1] == 1
    with pytest.raises(ValueError, match=r"rollout \(num_frames, height, width\) = \(9, 64, 32\), but model.options"):
        policy.latent_shapes(MediaShape(64, 32, frames=9))
    with pytest.raises(ValueError, match="needs num_frames >= 5"):
        WanI2VPolicy(_cfg(path, (1, 64, 32)), torch.device("cpu")).latent_shapes(MediaShape(64, 32, frames=1))
    with pytest.raises(ValueError, match=r"carries none \(each data row needs an `image` column"):
        policy.encode_prompts([PROMPT])
    with pytest.raises(UserError, match=r"model.options.height=None"):
        WanI2VPolicy(_cfg(path, (5, None, 32)), torch.device("cpu"))
    with pytest.raises(ValueError, match="takes 16 channels, but channel-concat I2V: .* are 36; a text-to-video"):
        WanI2VPolicy(_cfg(tiny_wan_dir, video), torch.device("cpu"))  # a Wan2.1 text-to-video checkpoint
    index = json.loads((path / "model_index.json").read_text())  # a checkpoint that wants CLIP image embeddings
    (path / "model_index.json").write_text(json.dumps({**index, "image_encoder": ["transformers", "CLIPVisionModel"]}))
    with pytest.raises(UserError, match="conditions on CLIP image embeddings"):
        WanI2VPolicy(_cfg(path, video), torch.device("cpu"))
    (path / "model_index.json").write_text(json.dumps(index))
    config = json.loads((path / "transformer" / "config.json").read_text())
    (path / "transformer" / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(UserError, match="conditions on CLIP image embeddings"):
        WanI2VPolicy(_cfg(path, video), torch.device("cpu"))


def _data(folder, rows):
    path = folder / "i2v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_two_steps_through_the_cli(tmp_path, images, layout):
    """`polyrl train recipe=wan22_ti2v_flowgrpo` on a tiny checkpoint and a jsonl whose `image` paths are relative to
    it: two full-fine-tune steps finish with finite rewards and gradients, and a checkpoint (A14B: both experts)."""
    (tmp_path / "data" / "img").mkdir(parents=True)
    for name in ("a.png", "b.png"):
        (tmp_path / "data" / "img" / name).write_bytes((images / name).read_bytes())
    data = _data(tmp_path / "data", [{"prompt": PROMPT, "image": "img/a.png"},
                                     {"prompt": "a blue dog", "image": "img/b.png"}])
    model = save_tiny_wan(TinyWanSpec(words=WORDS, image_to_video=True, **LAYOUTS[layout][0]), tmp_path / "model")
    out = tmp_path / "run"
    args = ["train", "recipe=wan22_ti2v_flowgrpo", "model.compile=none", f"model.path={model}", f"data.path={data}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "model.dtype=float32",
            "model.max_sequence_length=16",
            "rollout.height=32", "rollout.width=32", "rollout.num_frames=5", "rollout.fps=8", "rollout.num_steps=3",
            "rollout.n=2", "rollout.batch_size=4", "rollout.sde_window_range=[0,1]", "data.prompts_per_step=2",
            "actor.num_minibatches=1", "actor.micro_batch_size=4", "actor.lr=1e-4", "reward.frames=2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["reward/mean"]) and r["grad_norm"] > 0 and r["train/samples"] == 4
    saved = {p.name for p in (out / "checkpoints" / "step_000002").glob("transformer*.safetensors")}
    assert saved == ({"transformer.safetensors", "transformer_2.safetensors"} if layout == "i2v-a14b"
                     else {"transformer.safetensors"})


@pytest.mark.parametrize("bad", ["missing", "unreadable"])
def test_bad_condition_image_is_one_error_line(tmp_path, images, capsys, bad):
    (tmp_path / "a.png").write_bytes((images / "a.png").read_bytes())
    if bad == "unreadable":
        (tmp_path / "b.png").write_bytes(b"not a png")
    data = _data(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "a blue dog", "image": "b.png"}])
    args = ["train", "recipe=wan22_ti2v_flowgrpo", "model.compile=none", "model.path=/nonexistent/ckpt", f"data.path={data}",
            f"trainer.output_dir={tmp_path / 'run'}", "rollout.height=32", "rollout.width=32", "rollout.num_frames=5"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    problem = "does not exist (looked for " if bad == "missing" else "is not a readable image ("
    problem += str(tmp_path / "b.png")
    assert err.startswith(f"polyrl: error: {data}:2: image 'b.png' {problem}") and len(err.splitlines()) == 1
    assert "Traceback" not in err
