"""Data parallel on CPU (gloo): a 2-process `torchrun` run equals the 1-process run with the same global batch.

Both runs sample every prompt group from the same noise (drawn for the whole step, then sliced per rank), in
chunks of the same shape, so rollouts and rewards agree exactly; the update sums gradients over ranks with the
losses normalised by the global mini-batch, so weights agree to the rounding of those sums. The networks run in
float64, so that rounding is float64's (one CPU's float32 kernels are not a contract: on an AVX-512 CPU this
comparison in float32 moved grad_norm by 4e-3 relative). The 2-process run stops at a checkpoint and a second run
resumes it (in the same launch; tests/test_elastic.py resumes in restarted ranks), which must change nothing either. Every algorithm's layouts: tests/test_layouts.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import launch_runs, train_in_process
from safetensors.torch import load_file

from polyrl.distributed import LocalEngine, ParallelDims
from polyrl.distributed.dims import shard_range

SKIP = ("time/", "perf/")


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_process_run_equals_one_process_run_with_resume(tiny_sd3_dir, shape_prompts_file, tmp_path):
    # Flow-GRPO with a KL term (recipe=toy_flow_grpo; the default recipe is DiffusionNFT)
    common = ["recipe=toy_flow_grpo", f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "model.max_sequence_length=16",
              "reward=jpeg_compressibility", "rollout.height=32", "rollout.width=32", "rollout.num_steps=4",
              "rollout.n=4", "data.prompts_per_step=4", "rollout.batch_size=4", "rollout.sde_window_size=2",
              "rollout.sde_window_range=[0,2]", "actor.lora_rank=4", "actor.lora_alpha=4", "actor.lr=1e-3",
              "actor.num_minibatches=2", "algorithm.kl_beta=0.01", "trainer.eval_every=3", "trainer.eval_samples=4",
              "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu",
              "model.dtype=float64"]
    one, two = tmp_path / "one", tmp_path / "two"
    # the 2-process run (2 steps, then a second run that resumes it from its step-2 checkpoint and trains step 3,
    # both in one launch) goes on while this process trains the one-process run (one thread each); a resume in
    # freshly started ranks: tests/test_elastic.py
    runs = {"first": common + ["trainer.max_steps=2", f"trainer.output_dir={two}"],
            "resumed": common + ["trainer.max_steps=3", f"trainer.output_dir={two}", "trainer.resume=auto"]}
    with launch_runs(runs, tmp_path, nproc=2) as launch:
        train_in_process(common + ["trainer.max_steps=3", f"trainer.output_dir={one}"])
        out = launch.wait(timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "codes.json").read_text()) == {"first": 0, "resumed": 0}, out.stderr[-3000:]
    assert "2 ranks: dp=2" in out.stderr and f"resuming run {two} from step_000002 (step 2)" in out.stderr
    assert (two / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()

    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [0, 1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        # the first 2-process segment also evaluates at its last step (2)
        skip = SKIP + (("eval/",) if a["step"] == 2 else ())
        keys = {k for k in a if not k.startswith(skip)}
        assert keys == {k for k in b if not k.startswith(skip)}
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), (a["step"], k, a[k], b[k])
    assert "eval/reward_mean" in m1[0] and "eval/reward_mean" in m2[3]
    assert m1[1]["reward/std"] > 0 and m1[1]["grad_norm"] > 0  # the runs did learn something to compare
    w1 = load_file(str(one / "checkpoints" / "step_000003" / "adapter_model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "step_000003" / "adapter_model.safetensors"))
    initial = load_file(str(two / "checkpoints" / "step_000001" / "adapter_model.safetensors"))
    assert w1.keys() == w2.keys() and all(k.startswith("transformer.") for k in w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-9, atol=1e-12)
    assert any(not torch.equal(w1[k], initial[k]) for k in w1)  # steps 2 and 3 moved the weights
    # only rank 0 wrote: one metrics line per step, one config
    assert sorted(p.name for p in two.iterdir() if p.is_file()) == ["config.yaml", "metrics.jsonl", "reward_curve.png",
                                                                   "status.json"]


def test_prompt_groups_must_split_evenly_over_ranks():
    assert list(shard_range(8, 1, 2)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        shard_range(8, 0, 3)
    assert not ParallelDims().dp_enabled and ParallelDims(dp=2).world_size == 2
    engine = LocalEngine(torch.device("cpu"))
    assert engine.is_main and list(engine.shard(4)) == [0, 1, 2, 3]
    t = torch.arange(3.0)
    assert torch.equal(engine.gather(t), t) and torch.equal(engine.sum(t), t)
