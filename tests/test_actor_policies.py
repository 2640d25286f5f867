"""The actor's policy contexts (polyrl/actor/local.py): old = EMA tensors swapped in and back, reference, teacher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from polyrl.actor.local import LocalActor
from polyrl.algorithms.base import AlgorithmBase
from polyrl.latents import MediaShape
from polyrl.models import build_model
from polyrl.models.base import Guidance
from polyrl.sampling.diffusion import SamplingPlan


def _actor(model_dir, ema_decay=0.5, teacher_path=None, lora_rank=4):
    cfg = OmegaConf.create({"name": "sd3", "path": str(model_dir), "dtype": "float32", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    actor_cfg = SimpleNamespace(lora_rank=lora_rank, lora_alpha=4.0, lora_targets=None, lr=1e-3, betas=(0.9, 0.999),
                                weight_decay=0.0, eps=1e-8, grad_clip=1.0, num_minibatches=1, micro_batch_size=0,
                                ema_decay=ema_decay)
    algo = AlgorithmBase()
    algo.teacher_path = teacher_path
    plan = SamplingPlan(num_steps=3, shape=MediaShape(32, 32), guidance=Guidance(1.0), noise_level=0.7)
    return LocalActor(adapter, actor_cfg, plan, algo), adapter


def _velocity(adapter, x, cond):
    return adapter.velocity({"x": x}, torch.full((x.shape[0],), 0.7), cond, {}, 1.0)["x"]


def test_old_policy_is_the_ema_and_is_swapped_back(tiny_sd3_dir):
    actor, adapter = _actor(tiny_sd3_dir)
    cond = adapter.encode_prompts(["a green triangle"])
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in actor.params]
    with torch.no_grad():
        for p in actor.params:  # a "training step": move every trainable tensor
            p.add_(0.05 * torch.randn_like(p))
    moved = [p.detach().clone() for p in actor.params]
    v_current = _velocity(adapter, x, cond)
    with actor.policy("old"):
        assert all(torch.equal(p, b) for p, b in zip(actor.params, before, strict=True))  # old = initial copy
        v_old = _velocity(adapter, x, cond)
    assert all(torch.equal(p, m) for p, m in zip(actor.params, moved, strict=True))  # swapped back
    assert not torch.allclose(v_old, v_current)
    with actor.reference():  # LoRA disabled: the base network, whatever the adapter weights
        v_ref = _velocity(adapter, x, cond)
    torch.testing.assert_close(v_ref, v_old, rtol=0, atol=1e-6)  # the initial LoRA (B = 0) is the base network
    # old ← d·old + (1−d)·θ with d = actor.ema_decay = 0.5
    actor._update_old(actor.algo)
    for o, b, m in zip(actor.old_params, before, moved, strict=True):
        torch.testing.assert_close(o, 0.5 * b + 0.5 * m, rtol=0, atol=1e-7)
    assert actor.num_updates == 1


def test_old_policy_needs_an_ema_copy(tiny_sd3_dir):
    actor, _ = _actor(tiny_sd3_dir, ema_decay=0.0)
    with pytest.raises(RuntimeError, match="the `old` policy needs an EMA copy"), actor.policy("old"):
        pass
    with pytest.raises(RuntimeError, match="needs algorithm.teacher_path"), actor.policy("teacher"):
        pass
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        actor.policy("nope")


def test_teacher_from_diffusers_dir_is_frozen_base(tiny_sd3_dir):
    actor, adapter = _actor(tiny_sd3_dir, ema_decay=0.0, teacher_path=str(tiny_sd3_dir))
    assert not any(p.requires_grad for p in actor.teacher_models["transformer"].parameters())
    cond = adapter.encode_prompts(["three yellow squares"])
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for p in actor.params:
            p.add_(0.05)
    v_student = _velocity(adapter, x, {k: v.expand(2, *v.shape[1:]) for k, v in cond.items()})
    with actor.policy("teacher"):
        v_teacher = _velocity(adapter, x, {k: v.expand(2, *v.shape[1:]) for k, v in cond.items()})
    with actor.reference():
        v_base = _velocity(adapter, x, {k: v.expand(2, *v.shape[1:]) for k, v in cond.items()})
    torch.testing.assert_close(v_teacher, v_base, rtol=0, atol=1e-6)
    assert not torch.allclose(v_student, v_teacher)
