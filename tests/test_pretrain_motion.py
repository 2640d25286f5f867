"""`polyrl pretrain-toy --task motion` at a tiny budget: the result is a diffusers Wan directory that the `wan` adapter
loads with the conventions the pretraining trained under (prompt embedding, σ·1000 timesteps, latents normalised by
the VAE config's statistics), and `recipe=toy_motion` trains one RL step on it through the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import ASSETS, load_config
from polyrl.latents import MediaShape
from polyrl.toy import motion_task
from polyrl.toy.pretrain.motion import (
    MOTION_FRAMES,
    MOTION_SIZE,
    _sample_motion_specs,
    encode_wan_prompts,
    render_clips,
    write_prompt_files,
)

NUM_CLIPS, SEED = 8, 3


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("motion")
    out, prompts = root / "model", root / "prompts"
    args = ["pretrain-toy", "--task", "motion", "--out", str(out), "--prompts-dir", str(prompts), "--vae-steps", "2",
            "--vae-batch", "2", "--steps", "3", "--batch", "4", "--num-clips", str(NUM_CLIPS), "--eval-samples", "2",
            "--seed", str(SEED)]
    assert main(args) == 0
    return out, prompts


@pytest.fixture(scope="module")
def adapter(pretrained):
    from polyrl.models import build_model

    cfg = load_config(["recipe=toy_motion", f"model.path={pretrained[0]}"])
    return build_model(cfg.model, torch.device("cpu"))


def test_writes_a_small_diffusers_directory_with_its_record(pretrained, tmp_path):
    out, prompts = pretrained
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer"][1] == "WanTransformer3DModel"
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) <= 25 * 2**20
    record = json.loads((out / "pretrain.json").read_text())
    assert record["task"] == "motion" and record["steps"] == 3 and record["num_clips"] == NUM_CLIPS
    assert (record["frames"], record["size"]) == (MOTION_FRAMES, MOTION_SIZE)
    assert len(record["losses"]["flow_curve"]) == 3 and math.isfinite(record["losses"]["flow_final"])
    assert 0.0 <= record["heldout_reward"] <= 1.0 and 0.0 <= record["vae_reconstruction_reward"] <= 1.0
    assert {"render", "vae", "encode", "flow", "eval", "total"} <= set(record["seconds"])
    # the prompt split, as shipped
    write_prompt_files(tmp_path, task_name="motion")
    for name in ("motion_train.jsonl", "motion_heldout.jsonl"):
        text = (prompts / name).read_text()
        assert text == (tmp_path / name).read_text() == (ASSETS / "prompts" / name).read_text()
    train = {json.loads(line)["prompt"] for line in (prompts / "motion_train.jsonl").read_text().splitlines()}
    held = {json.loads(line)["prompt"] for line in (prompts / "motion_heldout.jsonl").read_text().splitlines()}
    assert train and held and not train & held


def test_wan_adapter_loads_it_with_the_trained_conventions(pretrained, adapter):
    out, _ = pretrained
    assert adapter.shift == 1.0 and adapter.latent_shapes(MediaShape(MOTION_SIZE, MOTION_SIZE, frames=MOTION_FRAMES)) \
        == {"x": (16, 3, 12, 12)}
    prompts = ["a red circle moving left", "a green triangle moving right and a yellow circle moving down", ""]
    # the batched embedding the transformer was trained on equals the adapter's per-prompt one
    with torch.no_grad():
        trained = encode_wan_prompts(adapter.text_encoder, adapter.tokenizer, prompts, 16)
    cond = adapter.encode_prompts(prompts)
    assert (cond["prompt_embeds"] - trained).abs().max() < 1e-5
    # the adapter's velocity at σ is the network's output at timestep σ·1000 (the pretraining call)
    x = torch.randn(3, 16, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        v = adapter.velocity({"x": x}, sigma, cond, {}, 1.0)["x"]
        ref = adapter.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=trained,
                                  return_dict=False)[0]
    assert (v - ref).abs().max() < 1e-5
    # latents_mean / latents_std are the statistics of the training clips' latents: the adapter's normalised
    # latents of the same clips (re-rendered from the same seed) have per-channel mean 0 and std 1
    vae = adapter.vae.config
    assert len(vae.latents_mean) == len(vae.latents_std) == 16
    rng = random.Random(SEED)
    specs = _sample_motion_specs(rng, NUM_CLIPS, motion_task.split_specs(0)[0])
    clips = render_clips(specs, rng).permute(0, 1, 4, 2, 3).float() / 255  # (B, T, 3, H, W)
    z = adapter.encode_media({"video": clips})["x"].transpose(0, 1).reshape(16, -1)
    assert z.mean(1).abs().max() < 1e-3 and (z.std(1) - 1).abs().max() < 1e-3


@pytest.mark.parametrize("recipe,window", [("toy_motion", []),  # DiffusionNFT: ODE rollout, no window
                                           ("toy_motion_flow_grpo", ["rollout.sde_window_size=2",
                                                                     "rollout.sde_window_range=[0,2]"])])
def test_toy_motion_recipe_trains_one_step(pretrained, tmp_path, recipe, window):
    out, prompts = pretrained
    run = tmp_path / "run"
    args = ["train", f"recipe={recipe}", f"model.path={out}", f"data.path={prompts / 'motion_train.jsonl'}",
            f"data.heldout_path={prompts / 'motion_heldout.jsonl'}", f"trainer.output_dir={run}", "trainer.max_steps=1",
            "trainer.eval_every=1", "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=1",
            "trainer.progress=false", "trainer.tensorboard=false", "rollout.num_steps=4", "rollout.n=2",
            "rollout.batch_size=4", "data.prompts_per_step=2", "actor.num_minibatches=1", *window]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    last = rows[-1]
    assert 0.0 <= last["reward/mean"] <= 1.0 and math.isfinite(last["loss"]) and last["train/samples"] == 4
    assert "reward_extra/motion/direction_acc" in last and "eval/reward_mean" in rows[0]
    assert (run / "samples" / "step_000001.mp4").is_file()
    from safetensors.torch import load_file

    state = load_file(str(run / "checkpoints" / "step_000001" / "adapter_model.safetensors"))
    assert state and all(k.startswith("transformer.") and "lora_" in k for k in state)


def test_shipped_motion_model_is_small_and_above_chance():
    """The shipped toy video model: a diffusers directory of at most 25 MB whose ODE samples on held-out prompts
    score well above a blank or random clip (0) and far from the maximum (1), so RL has room."""
    from polyrl.toy.pretrain.motion import evaluate_motion

    root = ASSETS / "toy_motion"
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) <= 25 * 2**20
    record = json.loads((root / "pretrain.json").read_text())
    assert record["task"] == "motion" and record["seconds"]["total"] <= 360  # made in at most 6 minutes
    score = evaluate_motion(root, ASSETS / "prompts" / "motion_heldout.jsonl", n=16)
    assert 0.12 < score < 0.6  # measured 0.225 (CPU, these 16 prompts and seeds); 64 prompts: 0.226
