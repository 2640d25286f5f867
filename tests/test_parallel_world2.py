"""actor.backend=fsdp2 on 2 CPU processes (gloo) equals the 1-process run: Ulysses sp2 with a padded text mask,
tensor parallel tp2, FSDP2 sharding dp_shard=2 and HSDP dp_replicate=2, with LoRA; and checkpoints resume across
world sizes (a 1-process checkpoint continued on 2 sharded ranks, a 2-rank sharded one continued in 1 process).

Every run trains the same tiny SD3.5-layout model (qk RMS norms, a dual-attention block) with Flow-GRPO and a KL term
(the reference policy is the LoRA-disabled network), rewarded from the latents by a fixed linear head (a reward
continuous in the samples: a JPEG size would turn float rounding into different integers). At 36 px the image is
9 × 9 = 81 tokens and the text 31 (16 CLIP + 15 T5), so sp2 pads both: the image pad sits in the middle of the
gathered key sequence ([image_0, text_0, image_1, text_1]), where a mask in the contiguous [image, text] order
masks the wrong keys (the held-out reward then differs by 1e-4 already at step 0). Micro-batches of 2 make the ranks' shares of a
mini-batch unequal at step 3 (5 and 3 samples): the sharded actor then runs zero-weight micro-batches to keep the
collectives in step. The parallel runs share one `torchrun` launch (this file is its entry point: imports once).

Float64 networks (`model.dtype=float64`, as tests/test_layouts.py): the layouts then differ by the order of float64
sums, not by a CPU's float32 kernels (in float32, a CPU without AVX moved a tp2 LoRA weight by 1.05e-6 against the
1e-6 this file held). What stays float32 in a float64 run (diffusers' timestep embedding, the stored trajectories)
still differs between sp2's and one process's shapes: measured 1.3e-8 relative on a grad_norm and 4.8e-9 absolute on a
LoRA weight, so this file holds 1e-7 relative on every logged number and 1e-7 on the weights (`FLOAT64_TOLERANCES`).
`assert_same`'s defaults are the float32 ones (1e-6) that tests/test_parallel_wan.py uses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SKIP = ("time/", "perf/")
PROMPTS = ["two red circles above a blue square", "a green triangle", "three yellow squares",
           "a blue circle to the left of a red triangle"]
HERE = Path(__file__).resolve()


# ----------------------------------------------------------------------------------------------- helpers
def build_fixture_dir(root: Path, heads: int = 2, head_dim: int = 16) -> dict[str, Path]:
    """A tiny SD3.5-layout pipeline, the prompts and a linear latent reward head under `root`."""
    from polyrl.models.tiny import TinySD3Spec, save_tiny_sd3
    from polyrl.rewards.heads import save_mlp_head

    words = sorted({w for p in PROMPTS for w in p.split()})
    model = save_tiny_sd3(TinySD3Spec(words=words, image_size=32, heads=heads, head_dim=head_dim,
                                      qk_norm="rms_norm", dual_attention_layers=(0,)), root / "model")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    torch.manual_seed(0)
    head = save_mlp_head(torch.nn.Sequential(torch.nn.Linear(8, 1)), root / "head.safetensors")
    return {"model": Path(model), "prompts": prompts, "head": Path(head)}


def common(paths: dict[str, Path], num_steps: int = 4) -> list[str]:
    return [f"model.path={paths['model']}", f"data.path={paths['prompts']}", "model.max_sequence_length=15",
            "reward=latent_predictor", f"reward.path={paths['head']}", "rollout.height=36", "rollout.width=36",
            f"rollout.num_steps={num_steps}", "rollout.n=4", "data.prompts_per_step=4", "rollout.batch_size=4",
            "trainer.eval_samples=2", "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.device=cpu", "model.dtype=float64"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_cli(args: list[str], cwd, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess | None:
    """`polyrl train ARGS` under `torchrun` with `nproc` ranks; nproc=1: the one-process reference, in this process
    (`train_in_process`; returns None)."""
    if nproc == 1:
        from conftest import train_in_process

        assert check, "the in-process run raises or asserts on failure"
        train_in_process(args)
        return None
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
                "polyrl"]
    out = subprocess.run(launcher + ["train", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def start_many(runs: list[list[str]], cwd, nproc: int):
    """Several training runs (override lists) one after the other in one `torchrun` launch of this file, started
    now (a `conftest.Background`: `.wait(timeout)` it, inside a `with`)."""
    from conftest import Background

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(HERE),
           json.dumps(runs)]
    return Background(cmd, cwd=cwd, env=_env())


def run_many(runs: list[list[str]], cwd, nproc: int) -> None:
    """`start_many`, awaited."""
    with start_many(runs, cwd, nproc) as launch:
        out = launch.wait(timeout=900)
    assert out.returncode == 0, out.stderr[-6000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# float64 networks: what differs is float64 summation order plus the float32 parts' shapes (measured above)
FLOAT64_TOLERANCES = dict(rel=1e-7, abs_=1e-12, weight_rtol=1e-7, weight_atol=1e-7)


def assert_same(reference: Path, run: Path, steps: list[int], weights: str, rel: float = 1e-6, abs_: float = 1e-6,
                weight_rtol: float = 0.0, weight_atol: float = 1e-6) -> None:
    """Every logged number of `steps` and the weights of the last one equal the reference run's (defaults: float32
    networks; a CPU's float32 kernels and the layouts' shapes move the last bits)."""
    ref = {m["step"]: m for m in metrics(reference)}
    got = {m["step"]: m for m in metrics(run)}
    for step in steps:
        a, b = ref[step], got[step]
        keys = {k for k in a if not k.startswith(SKIP)}
        assert keys == {k for k in b if not k.startswith(SKIP)}, (step, keys ^ set(b))
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=rel, abs=abs_), (run.name, step, k, a[k], b[k])
    last = f"checkpoints/step_{steps[-1]:06d}/{weights}"
    w_ref, w_run = load_file(str(reference / last)), load_file(str(run / last))
    assert w_ref.keys() == w_run.keys()
    for k in w_ref:
        torch.testing.assert_close(w_run[k], w_ref[k], rtol=weight_rtol, atol=weight_atol,
                                   msg=lambda m, k=k: f"{run.name} {k}: {m}")


def continue_from(run: Path, step: int, into: Path) -> str:
    """A copy of `run` to continue from its checkpoint of `step` (resuming writes into the run's directory)."""
    shutil.copytree(run, into)
    for later in (into / "checkpoints").iterdir():
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    return f"trainer.resume={into / 'checkpoints' / f'step_{step:06d}'}"


# ----------------------------------------------------------------------------------------------- test
# Flow-GRPO with a KL term (recipe=toy_flow_grpo: the default recipe is DiffusionNFT, which has no KL)
LORA = ["recipe=toy_flow_grpo", "actor.lora_rank=4", "actor.lora_alpha=4", "actor.lr=1e-3", "actor.num_minibatches=2",
        "actor.micro_batch_size=2", "algorithm.kl_beta=0.01", "rollout.sde_window_size=2",
        "rollout.sde_window_range=[0,2]", "trainer.eval_every=2"]


def test_sp_tp_fsdp_hsdp_equal_one_process_and_resume_across_world_sizes(tmp_path):
    paths = build_fixture_dir(tmp_path)
    base = common(paths) + LORA
    fsdp = ["actor.backend=fsdp2"]
    ref = tmp_path / "one"
    run_cli(base + ["trainer.max_steps=3", f"trainer.output_dir={ref}"], tmp_path)

    sp, tp, hsdp = tmp_path / "sp2", tmp_path / "tp2", tmp_path / "hsdp2"
    sharded = tmp_path / "dp_shard2_from_one"  # written at world 1 (step 1), continued on 2 sharded ranks
    resume_sharded = continue_from(ref, 1, sharded)
    run_many([base + fsdp + ["parallel.sp=2", "trainer.max_steps=2", f"trainer.output_dir={sp}"],
              base + fsdp + ["parallel.tp=2", "trainer.max_steps=2", f"trainer.output_dir={tp}"],
              base + fsdp + ["parallel.dp_replicate=2", "trainer.max_steps=2", f"trainer.output_dir={hsdp}"],
              base + fsdp + ["parallel.dp_shard=2", "trainer.max_steps=3", resume_sharded]], tmp_path, nproc=2)
    single = tmp_path / "one_from_sp2"  # written sharded by 2 ranks (step 2), continued in one process
    run_cli(base + ["trainer.max_steps=3", continue_from(sp, 2, single)], tmp_path)

    adapter = "adapter_model.safetensors"
    for run in (sp, tp, hsdp):
        assert_same(ref, run, [0, 1, 2], adapter, **FLOAT64_TOLERANCES)
    assert_same(ref, sharded, [2, 3], adapter, **FLOAT64_TOLERANCES)
    assert_same(ref, single, [3], adapter, **FLOAT64_TOLERANCES)
    first = metrics(ref)
    assert first[1]["grad_norm"] > 0 and first[1]["kl"] > 0 and "eval/reward_mean" in first[0]
    # step 3 (index 2) shuffles its 16 samples so that rank 0 holds 5 and 3 of the two mini-batches' 8: with
    # micro-batches of 2 the ranks ran 3 and 2 forwards, so the sharded actor's padding micro-batch ran
    from polyrl.sampling.base import step_generator

    order = torch.randperm(16, generator=step_generator(0, 2, stream=1))
    assert [int((mb < 8).sum()) for mb in order.chunk(2)] == [5, 3]
    # the sharded checkpoint: rank 0's gathered LoRA-only export, every rank's shards, all checksummed
    ckpt = sp / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "weights.json").read_text())["sharded"] == "distcp"
    listed = json.loads((ckpt / "checksums.json").read_text())["files"]
    assert any(name.startswith("distcp/") for name in listed) and "adapter_model.safetensors" in listed
    assert all(k.startswith("transformer.") and ".lora_" in k for k in load_file(str(ckpt / adapter)))
    assert not (ckpt / "old_weights.safetensors").exists()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["optimizer"]["sharded"] == "distcp" and "state" not in state["optimizer"]
    # only rank 0 wrote the run's files
    assert sorted(p.name for p in sp.iterdir() if p.is_file()) == ["config.yaml", "metrics.jsonl", "reward_curve.png", "status.json"]


# ----------------------------------------------------------------------------------------------- torchrun entry
def _train_each(runs: list[list[str]]) -> None:
    import torch.distributed as dist

    from polyrl.config import load_config
    from polyrl.trainer.loop import Trainer

    for overrides in runs:
        trainer = Trainer(load_config(overrides), overrides)
        trainer.fit()
        trainer.reward_stage.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    _train_each(json.loads(sys.argv[1]))
