"""A tiny Wan text-to-video pipeline (built and saved by the test) trains through the CLI with the Wan2.2 recipe:
video latents through the same rollout, reward (image scorer on sampled frames), update and checkpoint as images;
the run writes metrics and a captioned grid video of held-out prompts."""

import json
import math

import av
import pytest
from safetensors.torch import load_file

from polyrl.cli.main import main


def test_wan_trains_two_steps_and_writes_a_grid_video(tiny_wan_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    args = ["train", "recipe=wan22_flowgrpo", "model.compile=none", f"model.path={tiny_wan_dir}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_samples=2",
            "trainer.num_validation=2", "trainer.save_every=2", "trainer.progress=false", "trainer.tensorboard=false",
            "model.dtype=float32", "model.max_sequence_length=16", "rollout.height=32", "rollout.width=32",
            "rollout.num_frames=5", "rollout.fps=8", "rollout.num_steps=4", "rollout.n=2", "rollout.batch_size=2",
            "rollout.sde_window_range=[0,2]", "data.prompts_per_step=2", "actor.num_minibatches=1",
            "actor.micro_batch_size=2", "actor.lr=1e-4", "reward.frames=2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert math.isfinite(r["reward/mean"]) and r["reward/std"] > 0  # jpeg_compressibility: −kB per frame
        assert r["grad_norm"] > 0 and r["train/samples"] == 4
        assert r["time/decode"] > 0 and r["perf/tflops"] > 0
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    video = out / "samples" / "step_000002.mp4"
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5  # one grid frame per generated frame
    h, w, _ = frames[0].shape
    assert w >= 2 * 64 and h > 64  # two captioned tiles of 32×32 at scale 2, side by side
    assert (out / "samples" / "step_000002.png").is_file()  # the middle frames as a PNG grid
    state = load_file(str(out / "checkpoints" / "step_000002" / "transformer.safetensors"))  # full fine-tune
    assert state and all(not k.startswith("transformer.") for k in state)


def test_wan_frames_must_be_4k_plus_1(tiny_wan_dir, shape_prompts_file, tmp_path, capsys):
    args = ["train", "recipe=wan22_flowgrpo", "model.compile=none", f"model.path={tiny_wan_dir}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={tmp_path / 'run'}", "model.dtype=float32", "rollout.height=32", "rollout.width=32",
            "rollout.num_frames=6", "trainer.max_steps=1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "polyrl: config error: rollout.num_frames=6" in err and "Traceback" not in err


def test_a14b_trains_both_experts_each_on_its_own_steps(shape_prompts_file, tmp_path):
    """Wan2.2-A14B layout (two experts switched at t = 0.875·1000): every network call goes to the expert whose
    side of the boundary its timesteps are on, both LoRA adapters receive gradients and move, and the checkpoint
    holds both (keys `transformer.…` and `transformer_2.…`)."""
    import torch
    from safetensors.torch import load_file

    from polyrl.config import load_config
    from polyrl.models.tiny import TinyWanSpec, save_tiny_wan
    from polyrl.trainer.loop import Trainer

    words = sorted(set(shape_prompts_file.read_text().split()))
    model = save_tiny_wan(TinyWanSpec(words=words, layout="wan2.1", boundary_ratio=0.875), tmp_path / "a14b")
    out = tmp_path / "run"
    cfg = load_config([
        "recipe=wan22_flowgrpo", "model.compile=none", f"model.path={model}", f"data.path={shape_prompts_file}", f"trainer.output_dir={out}",
        "trainer.max_steps=1", "trainer.eval_every=0", "trainer.save_every=1", "trainer.progress=false",
        "trainer.tensorboard=false", "model.dtype=float32", "model.max_sequence_length=16", "model.shift=3.0",
        "rollout.height=32", "rollout.width=32", "rollout.num_frames=5", "rollout.num_steps=4",
        "rollout.sde_window_size=3", "rollout.sde_window_range=[0,1]", "rollout.n=2", "rollout.batch_size=4",
        "data.prompts_per_step=2", "actor.lora_rank=4", "actor.lora_alpha=4", "actor.lr=1e-2",
        "actor.num_minibatches=1", "actor.micro_batch_size=4", "reward.frames=2"])
    trainer = Trainer(cfg)
    seen = {"transformer": [], "transformer_2": []}
    for name, network in trainer.adapter.modules().items():
        network.register_forward_pre_hook(
            lambda _m, _a, kw, name=name: seen[name].append(kw["timestep"].flatten()), with_kwargs=True)
    trainer.fit()
    trainer.close()
    high, low = torch.cat(seen["transformer"]), torch.cat(seen["transformer_2"])
    assert len(high) and len(low) and bool((high >= 875).all()) and bool((low < 875).all())
    state = load_file(str(out / "checkpoints" / "step_000001" / "adapter_model.safetensors"))
    for expert in ("transformer", "transformer_2"):
        lora_b = [v for k, v in state.items() if k.startswith(expert + ".") and "lora_B" in k]
        assert lora_b and any(v.abs().sum() > 0 for v in lora_b), expert  # B starts at 0: only a gradient moves it


def test_a14b_recipe_trains_both_experts(shape_prompts_file, tmp_path):
    """`recipe=wan22_a14b_flowgrpo` as published (10 steps, shift 12, windows starting at 0..8, guidance 4 / 3) on a
    tiny two-expert checkpoint: two CLI steps, and both experts' LoRA adapters moved (the window reaches the
    low-noise steps 7–9)."""
    from polyrl.models.tiny import TinyWanSpec, save_tiny_wan

    words = sorted(set(shape_prompts_file.read_text().split()))
    model = save_tiny_wan(TinyWanSpec(words=words, layout="wan2.1", boundary_ratio=0.875), tmp_path / "a14b")
    out = tmp_path / "run"
    args = ["train", "recipe=wan22_a14b_flowgrpo", "model.compile=none", f"model.path={model}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "model.dtype=float32", "model.max_sequence_length=16",
            "rollout.height=32", "rollout.width=32", "rollout.num_frames=5", "rollout.n=4", "data.prompts_per_step=2",
            "actor.num_minibatches=1", "actor.micro_batch_size=4", "actor.lr=1e-2", "reward.frames=2"]
    assert main(args) == 0
    state = load_file(str(out / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    for expert in ("transformer", "transformer_2"):
        lora_b = [v for k, v in state.items() if k.startswith(expert + ".") and "lora_B" in k]
        assert lora_b and any(v.abs().sum() > 0 for v in lora_b), expert  # B starts at 0: only a gradient moves it


def test_gradient_checkpointing_changes_no_number(tiny_wan_dir, shape_prompts_file, tmp_path):
    """actor.gradient_checkpointing recomputes block activations in the backward: same loss, gradients, weights."""
    rows, states = [], []
    for flag in ("false", "true", "0.5"):
        out = tmp_path / flag
        args = ["train", "recipe=wan22_flowgrpo", "model.compile=none", f"model.path={tiny_wan_dir}", f"data.path={shape_prompts_file}",
                f"trainer.output_dir={out}", "trainer.max_steps=1", "trainer.eval_every=0", "trainer.save_every=1",
                "trainer.progress=false", "trainer.tensorboard=false", "model.dtype=float32",
                "model.max_sequence_length=16", "rollout.height=32", "rollout.width=32", "rollout.num_frames=5",
                "rollout.num_steps=4", "rollout.n=2", "rollout.batch_size=4", "rollout.sde_window_range=[0,2]",
                "data.prompts_per_step=2", "actor.num_minibatches=1", "actor.micro_batch_size=4", "actor.lr=1e-3",
                "reward.frames=2", f"actor.gradient_checkpointing={flag}"]
        assert main(args) == 0
        rows.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]))
        states.append(load_file(str(out / "checkpoints" / "step_000001" / "transformer.safetensors")))
    for row, state in zip(rows[1:], states[1:], strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "ratio_mean"):
            assert row[key] == pytest.approx(rows[0][key], rel=1e-6, abs=1e-9), key
        for k in states[0]:
            assert (states[0][k] - state[k]).abs().max() < 1e-6, k
    assert rows[0]["grad_norm"] > 0
