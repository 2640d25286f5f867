"""`polyrl export`: the LoRA file plain diffusers loads and applies exactly as polyrl does, the merged pipeline
directory, and the shipped toy model in plain StableDiffusion3Pipeline."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from omegaconf import OmegaConf
from safetensors.torch import load_file

from polyrl.actor.local import load_trained_weights
from polyrl.cli.main import main
from polyrl.models import build_model


def _train(model_dir, prompts, out, *extra):
    args = ["train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
            "trainer.max_steps=1", "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2",
            "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=1",
            "reward=jpeg_compressibility", "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]",
            "actor.lr=0.05", *extra]
    assert main(args) == 0
    return out / "checkpoints" / "step_000001"


def _inputs(transformer):
    c = transformer.config
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(2, c.in_channels, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 7, c.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=g),
                timestep=torch.tensor([250.0, 750.0]), return_dict=False)


@torch.no_grad()
def _ours(model_dir, ckpt):
    """The transformer output of polyrl's own adapter with the checkpoint loaded (what training and sampling use)."""
    cfg = OmegaConf.create({"name": "sd3", "path": str(model_dir), "dtype": "float32", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    base = adapter.transformer(**_inputs(adapter.transformer))[0]
    load_trained_weights(adapter, ckpt)
    return base, adapter.transformer(**_inputs(adapter.transformer))[0]


@pytest.fixture(scope="module")
def lora_run(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    # alpha != rank: a loader that ignores alpha would apply the update at the wrong scale
    ckpt = _train(tiny_sd3_dir, shape_prompts_file, tmp_path_factory.mktemp("lora") / "run", "actor.lora_rank=4",
                  "actor.lora_alpha=12")
    return ckpt, *_ours(tiny_sd3_dir, ckpt)


def test_lora_export_loads_and_applies_in_plain_diffusers(tiny_sd3_dir, lora_run, tmp_path, capsys):
    ckpt, base, ours = lora_run
    assert (ours - base).abs().max() > 1e-3  # the adapter does change the output
    out = tmp_path / "lora"
    assert main(["export", f"checkpoint={ckpt}", f"out={out}"]) == 0
    assert "pipe.load_lora_weights" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir))
    pipe.load_lora_weights(str(out))
    with torch.no_grad():
        theirs = pipe.transformer(**_inputs(pipe.transformer))[0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # the checkpoint's own file, loaded by diffusers without the adapter's alpha, applies another update
    raw = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir))
    raw.load_lora_weights(str(ckpt), weight_name="adapter_model.safetensors")
    with torch.no_grad():
        wrong = raw.transformer(**_inputs(raw.transformer))[0]
    assert (wrong - ours).abs().max() > 1e-3


def test_merged_export_is_a_pipeline_with_the_adapter_merged(tiny_sd3_dir, lora_run, tmp_path):
    ckpt, _, ours = lora_run
    out = tmp_path / "merged"
    assert main(["export", f"checkpoint={ckpt}", f"out={out}", "--merge"]) == 0
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out))
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    with torch.no_grad():
        merged = pipe.transformer(**_inputs(pipe.transformer))[0]
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-5)
    base = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir))
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):  # untouched networks stay the same
        a, b = getattr(pipe, name).state_dict(), getattr(base, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), name
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=16,
                 output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_full_finetune_exports_merged_only(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    ckpt = _train(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", "actor.lora_rank=0", "actor.lr=1e-3")
    assert main(["export", f"checkpoint={ckpt}", f"out={tmp_path / 'x'}"]) == 2
    assert "holds a full fine-tune, not a LoRA adapter; export it with --merge" in capsys.readouterr().err
    out = tmp_path / "merged"
    assert main(["export", f"checkpoint={ckpt}", f"out={out}", "--merge"]) == 0
    trained = load_file(str(ckpt / "transformer.safetensors"))
    exported = StableDiffusion3Pipeline.from_pretrained(str(out)).transformer.state_dict()
    assert trained.keys() == exported.keys() and all(torch.equal(trained[k], exported[k]) for k in trained)
    # out= must not hold anything already
    assert main(["export", f"checkpoint={ckpt}", f"out={out}", "--merge"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_shipped_toy_model_generates_in_plain_diffusers_as_in_polyrl():
    """The toy model has no T5: diffusers is told so (text_encoder_3=None) and adds no T5 tokens
    (max_sequence_length=0); its images then equal polyrl's deterministic samples from the same noise."""
    from polyrl.config import ASSETS, load_config
    from polyrl.rewards.shapes import ShapesReward
    from polyrl.sampling.diffusion import draw_noise, plan_from_config, rollout

    rows = [json.loads(line) for line in (ASSETS / "prompts" / "shapes_heldout.jsonl").read_text().splitlines()][:8]
    prompts = [r["prompt"] for r in rows]
    cfg = load_config([])
    adapter = build_model(cfg.model, torch.device("cpu"))
    plan = replace(plan_from_config(cfg.rollout), noise_level=0.0, window_size=0)
    groups = torch.arange(len(prompts))
    noise = draw_noise(adapter.latent_shapes(plan.shape), plan, groups, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(adapter, prompts, [{}] * len(prompts), groups, plan, noise).media["images"]

    pipe = StableDiffusion3Pipeline.from_pretrained(str(ASSETS / "toy_shapes"), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompts, num_inference_steps=plan.num_steps, height=64, width=64, guidance_scale=1.0,
                  latents=noise.initial["x"].clone(), max_sequence_length=0, output_type="pt").images
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    meta = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    assert ShapesReward()(theirs, prompts, meta).scores.mean() > 0.6  # it draws the shapes it is asked for


def test_merged_export_of_the_shipped_toy_model_loads_with_the_printed_line(shape_prompts_file, tmp_path, capfd):
    """The toy model has no T5 (text_encoder_3, tokenizer_3 null in model_index.json, which diffusers requires): the
    export keeps them null without diffusers' "cannot be saved" warning and prints the line that loads the result,
    which is run here as printed."""
    import logging
    import re

    from polyrl.config import ASSETS

    ckpt = _train(ASSETS / "toy_shapes", shape_prompts_file, tmp_path / "run")
    capfd.readouterr()
    out = tmp_path / "merged"
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(handler)  # diffusers' own logger does not propagate to caplog
    try:
        assert main(["export", f"checkpoint={ckpt}", f"out={out}", "--merge"]) == 0
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert not [w for w in warnings if "cannot be saved" in w], warnings
    err = capfd.readouterr().err
    line = re.search(r"load it with (.*)$", err, re.M).group(1)
    assert line == f"StableDiffusion3Pipeline.from_pretrained({str(out)!r}, text_encoder_3=None, tokenizer_3=None)"
    pipe = eval(line, {"StableDiffusion3Pipeline": StableDiffusion3Pipeline})  # exactly what the user is told to run
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    trained = load_file(str(ckpt / "adapter_model.safetensors"))
    base = StableDiffusion3Pipeline.from_pretrained(str(ASSETS / "toy_shapes"), text_encoder_3=None, tokenizer_3=None)
    with torch.no_grad():
        moved = (pipe.transformer(**_inputs(pipe.transformer))[0] - base.transformer(**_inputs(base.transformer))[0])
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in trained.items()) and moved.abs().max() > 0
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, guidance_scale=1.0, max_sequence_length=0,
                 output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
