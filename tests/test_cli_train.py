"""End to end through the CLI: a tiny SD3 pipeline saved to disk, trained with `polyrl train`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from polyrl.cli.main import main


def _common(model_dir, prompts, out, steps, extra=()):
    return [
        "train", f"model.path={model_dir}", f"data.path={prompts}", f"data.heldout_path={prompts}",
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32",
        "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
        "rollout.guidance_scale=2.0", "model.max_sequence_length=16", "trainer.eval_samples=4",
        "trainer.num_validation=4", "trainer.progress=false", "trainer.tensorboard=false",
        "reward=jpeg_compressibility", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", *extra,
    ]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_on_tiny_sd3_then_a_fresh_run_refuses_its_dir(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    # Flow-GRPO (the default recipe is DiffusionNFT): its clip and KL metrics
    args = _common(tiny_sd3_dir, shape_prompts_file, out, 2, ["recipe=toy_flow_grpo", "trainer.eval_every=2",
                                                             "trainer.save_every=2", "algorithm.kl_beta=0.04",
                                                             "trainer.tensorboard=true"])
    assert main(args) == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "reward/std", "zero_std_ratio", "loss", "clip_frac", "kl", "grad_norm",
                "time/rollout", "time/reward", "time/train"):
        assert key in rows[1], key
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    assert rows[1]["grad_norm"] > 0  # the LoRA actually received gradients
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "trainer_state.pt").is_file()
    assert (out / "config.yaml").is_file() and (out / "reward_curve.png").is_file()
    assert (out / "samples" / "step_000000.png").is_file() and (out / "samples" / "step_000002.png").is_file()
    assert list((out / "tensorboard").glob("events.*"))
    # A LoRA B matrix moved away from its zero init.
    state = load_file(str(ckpt / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in state.items())
    # `polyrl sample` renders a grid from the checkpoint.
    grid = tmp_path / "grid.png"
    assert main(["sample", f"checkpoint={ckpt}", "n=4", f"out={grid}"]) == 0
    assert grid.is_file()
    # the same command again, without trainer.resume: the run directory holds a checkpoint, so it refuses
    capsys.readouterr()
    assert main(args) == 2
    assert "trainer.resume=auto" in capsys.readouterr().err


def test_num_validation_zero_evaluates_without_writing_sample_grids(tiny_sd3_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    assert main(_common(tiny_sd3_dir, shape_prompts_file, out, 1, ["trainer.eval_every=1", "trainer.save_every=0",
                                                                   "trainer.num_validation=0"])) == 0
    rows = _metrics(out)
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[1]
    assert not list(out.glob("samples/step_*.png")) and list(out.glob("samples/step_*.jsonl"))


def test_resume_matches_uninterrupted_run(tiny_sd3_dir, shape_prompts_file, tmp_path):
    """A run split 2 + 2 steps equals a 4-step run (deterministic mode, CPU)."""
    extra = ["trainer.eval_every=0", "trainer.save_every=2", "trainer.deterministic=true", "actor.num_minibatches=2"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(_common(tiny_sd3_dir, shape_prompts_file, full, 4, extra)) == 0
    assert main(_common(tiny_sd3_dir, shape_prompts_file, split, 2, extra)) == 0
    assert main(_common(tiny_sd3_dir, shape_prompts_file, split, 4, extra + ["trainer.resume=auto"])) == 0

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/achieved"))} for r in rows]

    a, b = strip(_metrics(full)), strip(_metrics(split))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    wa = load_file(str(full / "checkpoints" / "step_000004" / "adapter_model.safetensors"))
    wb = load_file(str(split / "checkpoints" / "step_000004" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_full_finetune_with_kl_runs(tiny_sd3_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    args = _common(tiny_sd3_dir, shape_prompts_file, out, 1,
                   ["recipe=toy_flow_grpo", "actor.lora_rank=0", "actor.lr=1e-5", "algorithm.kl_beta=0.1",
                    "trainer.eval_every=0", "trainer.save_every=1"])  # Flow-GRPO's KL to the reference
    assert main(args) == 0
    assert (out / "checkpoints" / "step_000001" / "transformer.safetensors").is_file()
    assert _metrics(out)[0]["kl"] >= 0


@pytest.mark.parametrize("subset", [("clip_l",), ("clip_g", "t5")])
def test_text_encoder_subsets_load(tmp_path, subset):
    from omegaconf import OmegaConf

    from polyrl.models import build_model
    from polyrl.models.tiny import TinySD3Spec, save_tiny_sd3

    path = save_tiny_sd3(TinySD3Spec(words=["a", "red", "circle"], text_encoders=subset, image_size=32), tmp_path / "m")
    cfg = OmegaConf.create({"name": "sd3", "path": str(path), "dtype": "float32", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    cond = adapter.encode_prompts(["a red circle", "a circle"])
    tcfg = adapter.transformer.config
    assert cond["prompt_embeds"].shape[-1] == tcfg.joint_attention_dim
    assert cond["pooled"].shape == (2, tcfg.pooled_projection_dim)
    from polyrl.latents import MediaShape

    shape = adapter.latent_shapes(MediaShape(32, 32))["x"]
    x = {"x": torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))}
    v = adapter.velocity(x, torch.ones(2), cond, {}, 1.0)
    assert v["x"].shape == x["x"].shape and torch.isfinite(v["x"]).all()
    assert adapter.decode(x)["images"].shape == (2, 3, 32, 32)


def test_missing_model_dir_is_a_clear_error(shape_prompts_file, tmp_path, capsys):
    args = ["train", f"model.path={tmp_path / 'nope'}", f"data.path={shape_prompts_file}",
            f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    assert "model_index.json" in capsys.readouterr().err
