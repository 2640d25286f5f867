"""Every registered algorithm gives the same run on every layout (docs/algorithms.md §7): 2 data-parallel ranks
(torchrun, gloo) = 1 process; micro-batches of 1 sample = the whole mini-batch in one forward; a run stopped at a
checkpoint and resumed = the uninterrupted run. The cases are read from the registry, so a new algorithm without a
case here fails `test_every_registered_algorithm_has_a_layout_case`.

The networks run in float64 (`model.dtype=float64`): the layouts then differ only in the order of float64 sums
(~1e-16 relative), not in one CPU's float32 rounding. What the tolerance (1e-9 relative on weights and logged
numbers) still covers: the float32 parts of a float64 run (stored trajectories, the VAE decode behind the rewards,
diffusers' float32 timestep embedding) see inputs that differ by ~1e-15 at the second step, which can flip a float32
rounding; a draw keyed by the layout instead of the sample moves these numbers by 1e-3 and more.

Runs: each algorithm trains 2 steps in this process (uninterrupted, with whole mini-batches, a checkpoint at every
step), then step 2 again, resumed from a copy of that run's step-1 checkpoint with micro-batches of 1 (the resume and
the micro-batched update of the same step: one launch instead of two), and once more on 2 ranks in one `torchrun`
launch for all algorithms (layouts_worker.py), started first: it runs while this process trains (one thread each).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import launch_runs
from safetensors.torch import load_file

from polyrl.algorithms import ALGORITHMS
from polyrl.cli.main import main

SKIP = ("time/", "perf/")
REL, ABS = 1e-9, 1e-12
TOKEN_ROWS = [{"prompt": f"question {i}: what comes after {i}?", "answer": str(i + 1)} for i in range(8)]

# algorithm -> its options (beyond `algorithm=<name>`): a KL or reference term where the algorithm has one, so that
# every policy the update can call (current, old, reference, teacher) is in the comparison
DIFFUSION = {
    "flow_grpo": ["algorithm.kl_beta=0.1"],
    "dance_grpo": [],
    "mix_grpo": ["rollout.sde_window_every=1"],
    "flow_dppo": ["algorithm.kl_beta=0.1"],
    "grpo_guard": ["algorithm.kl_beta=0.1"],
    "diffusion_nft": ["algorithm.num_timesteps=2", "algorithm.ref_coef=0.01", "algorithm.decay_slope=0.3"],
    "awm": ["algorithm.num_timesteps=2", "algorithm.kl_beta=0.1", "algorithm.time_sampling=uniform"],
    "dgpo": ["algorithm.num_timesteps=2", "algorithm.kl_beta=0.1"],
    "diffusion_dpo": ["algorithm.num_timesteps=2"],
    "diffusion_opd": ["algorithm.policy_gradient=true", "teacher"],
}
TOKENS = {
    "grpo": [],
    "dapo": [],
    "gspo": [],
    "dpo": [],
    "opd": ["algorithm.task_loss=grpo", "teacher"],
}
# each algorithm's own metrics, beside loss and grad_norm
KEYS = {"flow_grpo": ("clip_frac", "kl"), "dance_grpo": ("clip_frac",), "mix_grpo": ("clip_frac",),
        "flow_dppo": ("drop_frac", "kl"), "grpo_guard": ("clip_frac", "kl"), "diffusion_nft": ("nft/err_pos", "ref_mse"),
        "awm": ("clip_frac", "kl"), "dgpo": ("clip_frac", "kl", "dgpo/group_weight"), "diffusion_dpo": ("dpo/accuracy",),
        "diffusion_opd": ("distill_kl", "clip_frac"), "grpo": ("clip_frac", "dual_clip_frac"),
        "dapo": ("clip_frac", "dapo/refills"), "gspo": ("clip_frac",), "dpo": ("dpo/accuracy",), "opd": ("clip_frac",)}
# one data-parallel rank only: its group preference needs every group in one micro-batch (algorithms/dgpo.py)
ONE_RANK_ONLY = {"dgpo": "needs every prompt group's samples in one micro-batch and runs on one data-parallel rank"}


def _diffusion_args(name, model, prompts, out):
    return [
        "recipe=toy_common", f"algorithm={name}", f"model.path={model}", "model.dtype=float64",
        f"data.path={prompts}", "data.heldout_path=null", "rollout.height=32", "rollout.width=32",
        "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=4", "rollout.batch_size=4",
        "rollout.guidance_scale=2.0", "model.max_sequence_length=16", "reward=jpeg_compressibility",
        "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", "actor.lora_rank=4", "actor.lora_alpha=4",
        "actor.lr=1e-3", "actor.num_minibatches=2", "trainer.eval_every=0", "trainer.save_every=1",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.seed=5",
        f"trainer.output_dir={out}",
        *[a if a != "teacher" else f"algorithm.teacher_path={model}" for a in DIFFUSION[name]],
    ]


def _token_args(name, model, data, out):
    return [
        "recipe=causal_lm_grpo", f"algorithm={name}", f"model.path={model}", "model.dtype=float64",
        f"data.path={data}", "rollout.n=2", "data.prompts_per_step=4", "rollout.max_new_tokens=5",
        "rollout.batch_size=4", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-3", "actor.num_minibatches=2",
        "reward=format", "reward.pattern='.*[a-m].*'", "trainer.eval_every=0", "trainer.save_every=1",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.seed=5",
        f"trainer.output_dir={out}",
        *[a if a != "teacher" else f"algorithm.teacher_path={model}" for a in TOKENS[name]],
    ]


@pytest.fixture(scope="module")
def cases(tiny_sd3_dir, tiny_qwen3_dir, shape_prompts_file, tmp_path_factory):
    """name -> a function of the output directory giving the run's arguments."""
    root = tmp_path_factory.mktemp("layouts")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TOKEN_ROWS))
    out = {n: (lambda d, n=n: _diffusion_args(n, tiny_sd3_dir, shape_prompts_file, d)) for n in DIFFUSION}
    out.update({n: (lambda d, n=n: _token_args(n, tiny_qwen3_dir, data, d)) for n in TOKENS})
    return out


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "adapter_model.safetensors"))


def _train(args: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the torchrun ranks' setting: the same kernels
    try:
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(threads)


def assert_same_run(a: Path, b: Path, what: str) -> None:
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2], what
    for x, y in zip(ma, mb, strict=True):
        assert set(x) == set(y), (what, x["step"], set(x) ^ set(y))
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=REL, abs=ABS), (what, x["step"], k, x[k], y[k])
    wa, wb = _weights(a, 2), _weights(b, 2)
    assert wa.keys() == wb.keys(), what
    for k in wa:
        assert wa[k].dtype == torch.float64, (what, k)  # the master weights of a float64 run
        torch.testing.assert_close(wb[k], wa[k], rtol=REL, atol=ABS, msg=lambda m, k=k: f"{what} {k}: {m}")


def test_every_registered_algorithm_has_a_layout_case():
    assert set(ALGORITHMS) == set(DIFFUSION) | set(TOKENS)


@pytest.fixture(scope="module")
def two_ranks_launch(cases, tmp_path_factory, request):
    """Every algorithm's 2-step run on 2 data-parallel ranks, all in one torchrun launch (layouts_worker.py), started
    before the one-process runs (`uninterrupted` asks for it first) so that it runs while they do, one thread each;
    (None, None) where no selected test compares the two layouts."""
    if not any("two_ranks" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None, None
        return
    root = tmp_path_factory.mktemp("two_ranks")
    with launch_runs({name: [*args(root / name), "trainer.max_steps=2"] for name, args in cases.items()}, root) as launch:
        yield root, launch


@pytest.fixture(scope="module")
def uninterrupted(cases, two_ranks_launch, tmp_path_factory):
    """Each algorithm's reference: 2 steps in one process, each mini-batch in one forward."""
    root = tmp_path_factory.mktemp("uninterrupted")
    for name, args in cases.items():
        _train(args(root / name) + ["trainer.max_steps=2"])
    return root


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_micro_batches_and_a_resume_change_nothing(name, cases, uninterrupted, tmp_path):
    ref = uninterrupted / name
    rows = _metrics(ref)
    for key in ("loss", "grad_norm", *KEYS[name]):
        assert key in rows[0] or key in rows[1], (name, key, sorted(rows[0]))
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # finite, not NaN
    assert rows[0]["grad_norm"] > 0 or name == "diffusion_dpo", rows[0]  # the run learned something to compare
    # a copy of the reference without its step-2 checkpoint (this run writes it); the resume drops the copied step-2
    # line of metrics.jsonl (a line left there would make the steps [1, 2, 2])
    split = tmp_path / "split"
    shutil.copytree(ref, split, ignore=lambda d, names: ["step_000002"] if Path(d).name == "checkpoints" else [])
    _train(cases[name](split) + ["trainer.max_steps=2", "actor.micro_batch_size=1",
                                 f"trainer.resume={split / 'checkpoints' / 'step_000001'}"])
    assert_same_run(ref, split, f"{name}: resumed at step 1, step 2 in micro-batches of 1 vs whole mini-batches")
    if rows[1]["train/samples"] > 0:  # step 2 trained (online DPO: where some group's rewards differ) and moved them
        assert any(not torch.equal(_weights(ref, 2)[k], _weights(ref, 1)[k]) for k in _weights(ref, 2))


@pytest.fixture(scope="module")
def two_ranks(two_ranks_launch):
    """(the runs' root, each run's exit code, the launch's stderr)."""
    root, launch = two_ranks_launch
    out = launch.wait(timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return root, json.loads((root / "codes.json").read_text()), out.stderr


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_two_ranks_equal_one_process(name, two_ranks, uninterrupted):
    root, codes, stderr = two_ranks
    if name in ONE_RANK_ONLY:  # refused with one line before any step
        assert codes[name] == 2 and ONE_RANK_ONLY[name] in stderr
        return
    assert codes[name] == 0, stderr[-3000:]
    assert_same_run(uninterrupted / name, root / name, f"{name}: 2 ranks vs 1 process")
