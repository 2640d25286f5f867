"""On-policy distillation for token policies (docs/algorithms.md §5 OPD): the k1 advantage and its PPO-clip loss
against a float64 loop, gradient included; two steps through `polyrl train` with a teacher; config errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from polyrl.algorithms.opd_tokens import opd_loss, reverse_kl_k1
from polyrl.cli.main import main

ROWS = [{"prompt": "what is one plus one?", "answer": "2"}, {"prompt": "count: a b c", "answer": "3"}]


def ref_opd(lp, old, teacher, mask, eps_lo, eps_hi, clamp):
    """seq_mean_token_mean of ℓ_t = max(−A_t·ρ_t, −A_t·clip(ρ_t)), A_t = −clamp(lp − teacher); and d/d lp."""
    b, r = lp.shape
    loss, grad = 0.0, np.zeros_like(lp)
    for i in range(b):
        n = mask[i].sum()
        for t in range(r):
            if not mask[i, t]:
                continue
            a = -min(max(lp[i, t] - teacher[i, t], -clamp), clamp)
            rho = math.exp(lp[i, t] - old[i, t])
            rc = min(max(rho, 1 - eps_lo), 1 + eps_hi)
            loss += max(-a * rho, -a * rc) / n / b
            if -a * rho >= -a * rc:  # the unclipped branch carries the gradient
                grad[i, t] = -a * rho / n / b
    return loss, grad


def test_opd_loss_and_gradient_match_reference():
    rng = np.random.default_rng(0)
    b, r = 3, 5
    lp = rng.normal(-2, 1, (b, r))
    old = lp + rng.normal(0, 0.3, (b, r))  # ratios well outside 1 ± 0.2 for some tokens: clipping is exercised
    teacher = lp + rng.normal(0, 4, (b, r))  # |k1| often above 3: the clamp at 3 is exercised
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], float)
    want, want_grad = ref_opd(lp, old, teacher, mask, 0.2, 0.28, 3.0)
    x = torch.tensor(lp, requires_grad=True)
    loss, ratio, clipped, _, k1 = opd_loss(x, torch.tensor(old), torch.tensor(teacher), torch.tensor(mask), 0.2, 0.28, 3.0)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-12, atol=1e-15)
    assert bool((clipped & torch.tensor(mask > 0)).any())  # the case covers clipped tokens
    np.testing.assert_allclose(k1.numpy(), np.clip(lp - teacher, -3, 3), rtol=1e-12)


def test_on_policy_gradient_is_minus_k1_score():
    """At ρ = 1 (old = current) the gradient of the OPD loss is −A_t/(n·B) = k1_t/(n·B): descending it lowers
    log π_θ where the student is above the teacher, i.e. it reduces the reverse KL estimate."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    loss, *_ = opd_loss(lp, lp.detach(), teacher, torch.ones(1, 3), 0.2, 0.2, None)
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), [[0.5 / 3, -1.0 / 3, 0.0]], rtol=1e-12)
    assert reverse_kl_k1(torch.tensor([30.0]), torch.tensor([0.0]), 10.0).item() == 10.0
    assert reverse_kl_k1(torch.tensor([30.0]), torch.tensor([0.0]), None).item() == 30.0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd_data")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root / "train.jsonl"


def _args(model, data, out, extra=()):
    return ["train", "recipe=causal_lm_grpo", f"model.path={model}", "model.dtype=float32", f"data.path={data}",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.n=4", "data.prompts_per_step=2",
            "rollout.max_new_tokens=6", "rollout.batch_size=8", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "trainer.tensorboard=false", "actor.lora_rank=4", "actor.lora_alpha=8",
            "actor.lr=1e-2", "actor.num_minibatches=1", "reward=format", "reward.pattern='.*[a-m].*'", *extra]


def test_opd_with_grpo_trains_two_steps(tiny_qwen3_dir, data, tmp_path):
    """Teacher = the base model. The LoRA starts as a no-op, so at step 1 the student is the teacher (k1 = 0 on every
    token); GRPO moves it, so at step 2 the reverse KL to the (frozen) teacher is no longer 0."""
    out = tmp_path / "run"
    assert main(_args(tiny_qwen3_dir, data, out, ["algorithm=opd", f"algorithm.teacher_path={tiny_qwen3_dir}",
                                                  "algorithm.task_loss=grpo", "algorithm.opd_coef=0.5"])) == 0
    rows = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("opd/reverse_kl", "opd/clip_frac", "opd/teacher_log_prob", "clip_frac", "policy_loss", "grad_norm"):
        assert key in rows[0], key
    assert rows[0]["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[1]["opd/reverse_kl"]) > 1e-4


def test_opd_needs_a_teacher(tiny_qwen3_dir, data, tmp_path, capsys):
    assert main(_args(tiny_qwen3_dir, data, tmp_path / "run", ["algorithm=opd"])) == 2
    assert "algorithm.teacher_path must be set" in capsys.readouterr().err
