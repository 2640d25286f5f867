"""actor.backend=veomni: the fsdp2 backend with VeOmni's parallel state and FSDP2 wrapping (distributed/veomni.py).

Always run (the main environment, where VeOmni does not import): the backend's one-line install error, never a
traceback, and its config refusals (parallel.sp / parallel.tp, a world of one), checked before any process group.

Run where VeOmni imports (the environment scripts/ci_veomni.sh builds; skipped elsewhere): on 2 CPU processes (gloo,
one `torchrun` launch of this file) the VeOmni-sharded runs equal the 1-process local runs after 2 steps, on every
logged number and the trained weights (float32, 1e-6, the harness of tests/test_parallel_world2.py):
- LoRA Flow-GRPO + KL with parallel.dp_shard=2 and with parallel.dp_replicate=2;
- the same as a full fine-tune (the KL term's `reference` is then a frozen copy, sharded by VeOmni too) with
  activation checkpointing, parallel.dp_shard=2.
(DiffusionNFT, as in tests/test_parallel_full.py, is not used here: its forward-process loss draws timesteps and
noise per data-parallel rank, so at dp=2 it equals a 1-process run in distribution only, with any backend; README,
"Several processes or GPUs".)
Each rank also records that VeOmni did the wrapping: the engine's meshes are VeOmni's current parallel state's,
every block and the root are FSDP2 units, and the networks carry the `clip_grad_norm_` VeOmni attaches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve()
# full fine-tune: the KL term's reference policy is a frozen copy of the network (sharded by VeOmni too); AdamW's eps
# 1e-4 as in tests/test_parallel_full.py (eps 1e-8 turns float rounding of ~1e-10 gradients into steps of ±lr)
FULL = ["actor.lora_rank=0", "actor.eps=1e-4", "actor.gradient_checkpointing=true"]


def _veomni_importable() -> bool:
    from polyrl.distributed.veomni import require_veomni
    from polyrl.errors import UserError

    try:
        require_veomni()
    except UserError:
        return False
    return True


VEOMNI = _veomni_importable()
if os.environ.get("POLYRL_REQUIRE_VEOMNI") and not VEOMNI:  # scripts/ci_veomni.sh: a broken install is a failure
    from polyrl.distributed.veomni import require_veomni

    require_veomni()  # raises with the reason
needs_veomni = pytest.mark.skipif(not VEOMNI, reason="VeOmni does not import here (bash scripts/ci_veomni.sh runs "
                                                      "this file in an environment where it does)")


@pytest.fixture
def base(tiny_sd3_dir, shape_prompts_file):
    return [f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}"]


# ----------------------------------------------------------------------------------------------- always
def _one_error_line(capsys, argv: list[str]) -> str:
    from polyrl.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_missing_veomni_is_one_error_line_naming_the_install(base, capsys, monkeypatch):
    if VEOMNI:  # the CI environment of this backend: hide the installed package
        monkeypatch.setitem(sys.modules, "veomni", None)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launch that would otherwise be valid
    line = _one_error_line(capsys, ["train", *base, "actor.backend=veomni"])
    assert line.startswith("polyrl: error: actor.backend=veomni needs VeOmni 0.1.12 with transformers>=5.9.0,<5.23")
    assert "(veomni is not installed)" in line
    assert line.endswith('(pip install "transformers>=5.9.0,<5.23" "datasets>=2.16" "torchdata<1.0" psutil && '
                         "pip install --no-deps veomni==0.1.12; see docs/distributed.md)")
    assert not dist.is_initialized()


@pytest.mark.skipif(VEOMNI, reason="needs the real VeOmni off the import path")
def test_veomni_that_fails_to_import_is_one_error_line(base, capsys, monkeypatch, tmp_path):
    """VeOmni 0.1.12 under transformers >= 5.23 raises ImportError at import: the reason is in the line."""
    fake = tmp_path / "site" / "veomni"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"cannot import name 'Qwen2_5OmniThinkerCausalLMOutputWithPast' "
                                      "from 'transformers.models.qwen2_5_omni.modeling_qwen2_5_omni'\")\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.setenv("WORLD_SIZE", "2")
    import transformers

    line = _one_error_line(capsys, ["train", *base, "actor.backend=veomni"])
    assert line.startswith("polyrl: error: actor.backend=veomni needs VeOmni 0.1.12")
    assert (f"import veomni failed with transformers {transformers.__version__}: cannot import name "
            "'Qwen2_5OmniThinkerCausalLMOutputWithPast'") in line
    assert "pip install --no-deps veomni==0.1.12; see docs/distributed.md)" in line


@pytest.mark.parametrize("world, keys, message", [
    (2, ["parallel.sp=2"], "parallel.sp=2 with actor.backend=veomni: only VeOmni's data-parallel sharding is wired "
                           "here (parallel.dp_shard, parallel.dp_replicate); use actor.backend=fsdp2"),
    (2, ["parallel.tp=2"], "parallel.tp=2 with actor.backend=veomni"),
    (1, [], "actor.backend=veomni shards over 2 or more ranks"),
    (2, ["recipe=causal_lm_grpo"], "actor.backend=veomni trains diffusion policies"),
    (2, ["parallel.dp_shard=4"], "world size 2 != parallel.dp_replicate × parallel.dp_shard"),
])
def test_unsupported_layouts_are_config_errors(base, monkeypatch, world, keys, message):
    """Checked as with fsdp2 (VeOmni's presence is not the question here: its check is replaced by a no-op)."""
    from polyrl.config import ConfigError, load_config

    monkeypatch.setattr("polyrl.distributed.veomni.require_veomni", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as e:
        load_config(base + ["actor.backend=veomni", *keys])
    assert message in str(e.value)
    assert not dist.is_initialized()
    # what is allowed: data-parallel sharding over the world
    assert load_config(base + ["actor.backend=veomni", "parallel.dp_replicate=2"]).actor.backend == "veomni" \
        if world == 2 else True


# ----------------------------------------------------------------------------------------------- VeOmni
@needs_veomni
def test_veomni_sharded_runs_equal_one_process(tmp_path):
    from test_parallel_world2 import FLOAT64_TOLERANCES, LORA, _env, assert_same, build_fixture_dir, common, run_cli

    paths = build_fixture_dir(tmp_path)
    lora = common(paths) + LORA + ["trainer.max_steps=2"]
    full = lora + FULL
    ref_lora, ref_full = tmp_path / "one_lora", tmp_path / "one_full"
    run_cli(lora + [f"trainer.output_dir={ref_lora}"], tmp_path)
    run_cli(full + [f"trainer.output_dir={ref_full}"], tmp_path)

    veomni = ["actor.backend=veomni"]
    shard, hsdp, full_shard = tmp_path / "lora_dp_shard2", tmp_path / "lora_dp_replicate2", tmp_path / "full_dp_shard2"
    runs = [lora + veomni + ["parallel.dp_shard=2", f"trainer.output_dir={shard}"],
            lora + veomni + ["parallel.dp_replicate=2", f"trainer.output_dir={hsdp}"],
            full + veomni + ["parallel.dp_shard=2", f"trainer.output_dir={full_shard}"]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE),
           json.dumps(runs)]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-6000:]

    for run in (shard, hsdp):
        assert_same(ref_lora, run, [0, 1, 2], "adapter_model.safetensors", **FLOAT64_TOLERANCES)
    assert_same(ref_full, full_shard, [0, 1, 2], "transformer.safetensors", **FLOAT64_TOLERANCES)
    for run, fsdp_dims in ((shard, ["dp_shard"]), (hsdp, ["dp_replicate", "dp_shard"]), (full_shard, ["dp_shard"])):
        for rank in (0, 1):
            seen = json.loads((run / f"veomni_rank{rank}.json").read_text())
            assert seen["actor"] == "VeOmniActor" and seen["engine"] == "VeOmniEngine"
            assert seen["state_is_veomni_current"] and seen["fsdp_mesh_dims"] == fsdp_dims
            assert seen["dp_size"] == 2 and seen["dp_rank"] == rank
            assert seen["clip_grad_norm_attached"] and seen["root_and_blocks_fsdp"]
            assert seen["sharded_params"] > 0
    assert json.loads((full_shard / "veomni_rank0.json").read_text())["frozen_copies_fsdp"]  # the reference copy


# ----------------------------------------------------------------------------------------------- torchrun entry
def _record(trainer, run_dir: Path) -> None:
    """What this rank's actor and engine are, as seen from VeOmni's side."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from veomni.distributed.parallel_state import get_parallel_state

    from polyrl.distributed.fsdp2 import blocks_of

    actor, engine = trainer.actor, trainer.engine
    networks = actor.adapter.modules()
    frozen = list((actor.reference_models or {}).values()) + list((actor.teacher_models or {}).values())
    seen = {
        "actor": type(actor).__name__, "engine": type(engine).__name__,
        "state_is_veomni_current": get_parallel_state() is engine.veomni_state,
        "fsdp_mesh_dims": list(engine.fsdp_mesh.mesh_dim_names), "dp_size": engine.dp_size, "dp_rank": engine.dp_rank,
        "clip_grad_norm_attached": all(hasattr(n, "clip_grad_norm_") for n in networks.values()),
        "root_and_blocks_fsdp": all(isinstance(m, FSDPModule) for n in networks.values()
                                    for m in [n, *blocks_of(n, None)]),
        "frozen_copies_fsdp": bool(frozen) and all(isinstance(n, FSDPModule) for n in frozen),
        "sharded_params": sum(isinstance(p, DTensor) for p in actor.params),
    }
    (run_dir / f"veomni_rank{engine.rank}.json").write_text(json.dumps(seen))


def _train_each(runs: list[list[str]]) -> None:
    from polyrl.config import load_config
    from polyrl.trainer.loop import Trainer

    for overrides in runs:
        trainer = Trainer(load_config(overrides), overrides)
        trainer.fit()
        trainer.reward_stage.close()
        _record(trainer, Path(trainer.run_dir))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    _train_each(json.loads(sys.argv[1]))
