"""Full fine-tune on 4 CPU processes: sequence parallel × tensor parallel (sp2 × tp2, the FSDP2 shards over the sp
ranks, 2-D DTensors over FSDP × TP) with activation checkpointing of half the blocks (one of the two: a checkpointed
and a plain block side by side) equals the 1-process run after 2 steps, launched the way a user does
(`torchrun --nproc-per-node=4 -m polyrl train ...`).

DiffusionNFT exercises every policy context on sharded weights: the rollout samples from the `old` (EMA) policy, the
loss re-scores with `old` (swapped in by value, shard by shard) and with the `reference` (a frozen copy, sharded the
same way). Full fine-tuning trains the per-head q/k RMS norms, whose gradients under tp come from local heads only
and must be summed over tp (without that sum the weights differ by 5e-4 after 2 steps).

The optimizer's eps is 1e-4 (not 1e-8) in both runs: Adam divides by √v, so for a weight whose gradient is ~1e-10
(some inputs of the timestep embedding) float rounding of the gradient becomes a step of ±lr, and 1e-3 · (rounding)
is not a parallelism error. With eps 1e-4 that division no longer amplifies noise, and the runs agree to 1e-7.
"""

from __future__ import annotations

import sys

from conftest import Background, train_in_process
from test_parallel_world2 import _env, assert_same, build_fixture_dir, common

FULL = ["recipe=toy_diffusion_nft", "rollout.noise_level=0.0", "rollout.sde_window_size=0",
        "rollout.sde_window_range=[0,0]", "algorithm.num_timesteps=1", "algorithm.decay=0.5", "algorithm.ref_coef=0.1", "actor.lora_rank=0",
        "actor.lr=1e-3", "actor.eps=1e-4", "actor.num_minibatches=2", "actor.gradient_checkpointing=0.5",
        "trainer.eval_every=2", "trainer.max_steps=2"]


def test_full_finetune_sp2_tp2_with_checkpointing_equals_one_process(tmp_path):
    paths = build_fixture_dir(tmp_path, heads=4, head_dim=8)
    base = common(paths, num_steps=2) + FULL  # Hydra applies the keys after composing the recipe, wherever they stand
    ref, par = tmp_path / "one", tmp_path / "sp2_tp2"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "polyrl"]
    # the 4 ranks run while this process trains the one-process run (one thread each)
    with Background(launcher + ["train", *base, "actor.backend=fsdp2", "parallel.sp=2", "parallel.tp=2",
                                f"trainer.output_dir={par}"], cwd=tmp_path, env=_env()) as launch:
        train_in_process(base + [f"trainer.output_dir={ref}"])
        out = launch.wait(timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "polyrl: run directory" in out.stderr
    assert_same(ref, par, [0, 1, 2], "transformer.safetensors")
