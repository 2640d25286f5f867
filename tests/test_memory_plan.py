"""The memory plan's arithmetic (trainer/memory_plan.py), exactly, against what a run really holds on tiny checkpoints:
every component's weight bytes in the dtype it is loaded in, the trainable parameters (LoRA r·(in + out) on the
targets; every parameter of a full fine-tune), the float32 master weights, gradients and AdamW moments after a step,
and the old / EMA copy. The activation terms are estimates calibrated on GPU runs (scripts/plan_calibration.py);
here only their inputs are checked. Also `polyrl plan`'s output and exit code, and the warning `polyrl train` gives
on a GPU when the plan exceeds the free memory."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from polyrl.cli.main import main
from polyrl.config import load_config
from polyrl.trainer import memory_plan
from polyrl.trainer.memory_plan import GIB, estimate_config, lora_parameters, matches, read_inventory


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _base_bytes(module: torch.nn.Module) -> int:
    """A network's own weights (its state_dict without LoRA's) as loaded, a tied tensor (T5's shared embedding) once."""
    unique = {v.untyped_storage().data_ptr(): v for k, v in module.state_dict().items() if "lora_" not in k}
    return _bytes(unique.values())


def _line(plan, start: str) -> float:
    return next(x.gib for x in plan.resident if x.what.startswith(start))


def _one_step(cfg):
    """The run's trainer after one optimizer step on zero gradients: every buffer a real step allocates (gradients,
    AdamW's moments) exists, without the rollout's seconds."""
    from polyrl.trainer.loop import Trainer

    trainer = Trainer(cfg)
    trainer.close()
    for p in trainer.actor.params:
        p.grad = torch.zeros_like(p)
    trainer.actor.optimizer.step()
    return trainer


def _adam_bytes(optimizer) -> int:
    return _bytes(v for state in optimizer.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))


def test_peft_target_matching():
    assert matches("transformer_blocks.0.attn.to_q", ["attn.to_q"]) and matches("to_q", ["to_q"])
    assert not matches("transformer_blocks.0.attn.to_qkv", ["to_q"]) and not matches("xattn.to_q", ["attn.to_q"])


def test_lora_sd3_bf16_counts_equal_the_run(tiny_sd3_dir, shape_prompts_file, tmp_path):
    cfg = load_config([f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "model.dtype=bfloat16",
                       f"trainer.output_dir={tmp_path / 'run'}", "trainer.max_steps=1", "trainer.eval_every=0",
                       "trainer.save_every=0", "trainer.progress=false", "trainer.tensorboard=false",
                       "rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.n=2",
                       "data.prompts_per_step=2", "rollout.batch_size=4", "model.max_sequence_length=16",
                       "actor.lora_rank=4", "actor.lora_alpha=8", "actor.ema_decay=0.5", "reward=jpeg_compressibility",
                       "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]"])
    plan = estimate_config(cfg)
    trainer = _one_step(cfg)
    actor, adapter = trainer.actor, trainer.adapter
    # weights: the transformer in bf16, the VAE in float32, the text encoders in bf16, each to the byte
    loaded = {"transformer": adapter.networks["transformer"], "vae": adapter.vae,
              **{name: enc for name, enc in zip(("text_encoder", "text_encoder_2", "text_encoder_3"),
                                                 adapter.text_encoders, strict=True) if enc is not None}}
    assert plan.counts["weights_bytes"] == {name: _base_bytes(m) for name, m in loaded.items()}
    assert next(adapter.networks["transformer"].parameters()).dtype == torch.bfloat16
    # LoRA: r·(in + out) per target, as peft made them; float32 master weights, gradients and AdamW moments
    assert plan.counts["trainable"] == actor.num_trainable > 0
    state = _bytes(actor.params) + _bytes(p.grad for p in actor.params) + _adam_bytes(actor.optimizer)
    assert all(p.dtype == torch.float32 and p.grad is not None for p in actor.params)
    assert _line(plan, "LoRA r4") * GIB == pytest.approx(state, rel=1e-12)
    assert _line(plan, "old / EMA copy") * GIB == pytest.approx(_bytes(actor.old_params), rel=1e-12)


def test_full_fine_tune_wan_counts_equal_the_run(tiny_wan_dir, shape_prompts_file, tmp_path):
    cfg = load_config(["recipe=wan22_flowgrpo", f"model.path={tiny_wan_dir}", f"data.path={shape_prompts_file}",
                       "model.dtype=float32", "model.compile=none", f"trainer.output_dir={tmp_path / 'run'}",
                       "trainer.max_steps=1", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
                       "trainer.tensorboard=false", "model.max_sequence_length=16", "rollout.height=32",
                       "rollout.width=32", "rollout.num_frames=5", "rollout.num_steps=3", "rollout.n=2",
                       "data.prompts_per_step=2", "rollout.batch_size=4", "actor.micro_batch_size=2",
                       "actor.num_minibatches=1", "rollout.sde_window_range=[0,1]", "reward.frames=2"])
    plan = estimate_config(cfg)
    trainer = _one_step(cfg)
    actor, network = trainer.actor, trainer.adapter.networks["transformer"]
    assert plan.counts["trainable"] == actor.num_trainable == sum(p.numel() for p in network.parameters())
    # what the checkpoint holds: parameters and persistent buffers; a non-persistent one (Wan's RoPE table, made at
    # load) is not in the file and not counted (96 KB here, a few MB at the published size)
    assert plan.counts["weights_bytes"]["transformer"] == _base_bytes(network) == _bytes(network.parameters())
    # a full fine-tune: gradients and both moments in float32, 12 B per parameter on top of the weights
    state = _bytes(p.grad for p in actor.params) + _adam_bytes(actor.optimizer)
    assert _line(plan, "full fine-tune") * GIB == pytest.approx(state, rel=1e-12)


def test_lora_causal_lm_counts_equal_the_run(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    from polyrl.actor.local import add_lora
    from polyrl.models import MODELS
    from polyrl.trainer.memory_plan import read_inventory

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir))
    targets = list(MODELS["causal_lm"].default_lora_targets)
    add_lora(model, 8, 16.0, targets)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    inventory = read_inventory(tiny_qwen3_dir)
    assert list(inventory) == ["model"]
    assert lora_parameters(inventory["model"], targets, 8) == real > 0


def test_the_plan_reads_headers_only(tiny_sd3_dir, tmp_path):
    inventory = read_inventory(tiny_sd3_dir)
    assert {"transformer", "vae", "text_encoder"} <= set(inventory)
    from safetensors.torch import load_file

    weights = load_file(str(next((tiny_sd3_dir / "transformer").glob("*.safetensors"))))
    assert inventory["transformer"].numel == sum(v.numel() for v in weights.values())
    with pytest.raises(FileNotFoundError, match="holds no"):
        read_inventory(tmp_path)


def test_polyrl_plan_prints_the_parts_and_the_change_that_fits(tiny_sd3_dir, shape_prompts_file, capsys, monkeypatch):
    base = ["plan", f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "rollout.height=512",
            "rollout.width=512", "data.prompts_per_step=8", "rollout.n=8", "actor.micro_batch_size=32",
            "rollout.guidance_scale=4.5"]
    assert main([*base, "--gpu-memory", "1000"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak per GPU" in out and "fits" in out and "weights: transformer" in out
    # a budget the micro-batch of 32 does not fit: the plan halves it until it does
    plan = estimate_config(load_config(base[1:]))
    smaller = estimate_config(load_config([*base[1:], "actor.micro_batch_size=16"]))
    budget = (plan.peak_gib + smaller.peak_gib) / 2
    assert main([*base, f"--gpu-memory={budget}"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "fits with: actor.micro_batch_size=16" in out
    assert main(["plan", "--gpus"]) == 2 and "--gpus needs a value" in capsys.readouterr().err


def test_train_warns_on_a_gpu_when_the_plan_exceeds_free_memory(tiny_sd3_dir, shape_prompts_file, monkeypatch):
    cfg = load_config([f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "actor.micro_batch_size=8"])
    monkeypatch.setattr("polyrl.perf.memory.free_memory_gib", lambda device=None: (0.5, 80.0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    warning = memory_plan.launch_warning(cfg)
    assert warning.startswith("polyrl: warning: the memory plan estimates ") and "0.5 GiB free on NVIDIA H100" in warning
    monkeypatch.setattr("polyrl.perf.memory.free_memory_gib", lambda device=None: (79.0, 80.0))
    assert memory_plan.launch_warning(cfg) is None
    assert memory_plan.launch_warning(OmegaConf.merge(cfg, {"trainer": {"device": "cpu"}})) is None
