"""Token policies data-parallel on CPU (gloo): a 2-process `torchrun` DAPO run (dynamic-sampling refills, token-level
normalisation over both ranks' tokens) equals the 1-process run, and micro-batches change no number."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import Background, train_in_process
from safetensors.torch import load_file

ROWS = [{"prompt": f"question {i}: what comes after {i}?", "answer": str(i + 1)} for i in range(6)]
SKIP = ("time/", "perf/")


def _launch(args, cwd, nproc=2) -> Background:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
                "polyrl"]
    return Background(launcher + ["train", *args], cwd=cwd, env=env)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _common(model, data):
    return ["recipe=causal_lm_grpo", "algorithm=dapo", f"model.path={model}", "model.dtype=float32",
            f"data.path={data}", "rollout.n=4", "data.prompts_per_step=2", "rollout.max_new_tokens=5",
            "rollout.batch_size=4", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-3", "actor.num_minibatches=2",
            "reward=format", "reward.pattern='.*[a-m].*'", "trainer.eval_every=0", "trainer.save_every=2",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.max_steps=2"]


def test_two_process_token_run_equals_one_process_run(tiny_qwen3_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    one, two = tmp_path / "one", tmp_path / "two"
    # the 2-process run goes on while this process trains the one-process run (one thread each)
    with _launch(_common(tiny_qwen3_dir, data) + [f"trainer.output_dir={two}"], tmp_path, nproc=2) as launch:
        train_in_process(_common(tiny_qwen3_dir, data) + [f"trainer.output_dir={one}"])
        out = launch.wait(timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 ranks: dp=2" in out.stderr
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2, strict=True):
        keys = {k for k in a if not k.startswith(SKIP)}
        assert keys == {k for k in b if not k.startswith(SKIP)}
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])
    assert m1[0]["grad_norm"] > 0 and "dapo/refills" in m1[0]
    w1 = load_file(str(one / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    assert w1.keys() == w2.keys() and all(k.startswith("model.") for k in w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)


def test_micro_batches_change_no_number(tiny_qwen3_dir, tmp_path):
    """DAPO's token-level normalisation over micro-batches: each weighs its share of the mini-batch's tokens."""
    from polyrl.cli.main import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    whole, micro = tmp_path / "whole", tmp_path / "micro"
    assert main(["train", *_common(tiny_qwen3_dir, data), f"trainer.output_dir={whole}"]) == 0
    assert main(["train", *_common(tiny_qwen3_dir, data), f"trainer.output_dir={micro}", "actor.micro_batch_size=1"]) == 0
    for a, b in zip(_metrics(whole), _metrics(micro), strict=True):
        for k in ("loss", "grad_norm", "policy_loss", "reward/mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
