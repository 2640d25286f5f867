"""Ulysses sequence parallel for Wan (`actor.backend=fsdp2 parallel.sp=2`, models/wan.py's `WAN_PARALLEL_PLAN`) on 2
CPU processes (gloo) equals the 1-process run, as tests/test_parallel_world2.py checks it for SD3 (its helpers).

Wan makes its video tokens inside the forward (Conv3d patch embedding, then flatten), so the plan splits them at the
first block's input, with the rotary table from `rope` and, for Wan2.2-TI2V, the per-token timesteps. The sizes are
chosen so that the token count is odd and sp2 pads: TI2V at 9 frames × 96 × 32 px is 3 latent frames × 6 × 2 latent
pixels, 3 × 3 × 1 = 9 tokens after the 1×2×2 patch (shares of 5, one pad key masked); the two-expert Wan2.2-A14B
layout (Wan2.1 VAE, per-sample timesteps, activation checkpointing: the first block's split runs again in each
recompute) at 1 frame × 48 × 16 px is 1 × 3 × 1 = 3 tokens. Rewards are read from the latents by a fixed linear head
(continuous in the samples). Float32; every logged number and the trained LoRA weights to 1e-6 (`assert_same`'s
defaults). Not float64 as tests/test_parallel_world2.py: in a float64 run the Wan parts that stay float32 (the
timestep and rotary embeddings, the stored trajectories) still move sp2's kl by 4.4e-6 relative from one process's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_parallel_world2 import LORA, PROMPTS, assert_same, metrics, run_cli, start_many

FSDP = ["actor.backend=fsdp2"]
ADAPTER = "adapter_model.safetensors"


def build_wan_fixture(root: Path, layout: str, boundary_ratio: float | None = None) -> dict[str, Path]:
    """A tiny Wan pipeline of `layout`, the prompts and a linear head on its latents' channel statistics."""
    from polyrl.models.tiny import TinyWanSpec, save_tiny_wan
    from polyrl.rewards.heads import save_mlp_head

    words = sorted({w for p in PROMPTS for w in p.split()})
    spec = TinyWanSpec(words=words, layout=layout, boundary_ratio=boundary_ratio)
    model = save_tiny_wan(spec, root / "model")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    torch.manual_seed(0)
    head = save_mlp_head(torch.nn.Sequential(torch.nn.Linear(2 * spec.z_dim, 1)), root / "head.safetensors")
    return {"model": Path(model), "prompts": prompts, "head": Path(head)}


def wan_args(paths: dict[str, Path], frames: int, height: int, width: int) -> list[str]:
    return ["model=wan", f"model.path={paths['model']}", f"data.path={paths['prompts']}", "model.dtype=float32",
            "model.max_sequence_length=8", "reward=latent_predictor", f"reward.path={paths['head']}",
            f"rollout.num_frames={frames}", f"rollout.height={height}", f"rollout.width={width}", "rollout.num_steps=4",
            "rollout.n=4", "data.prompts_per_step=4", "rollout.batch_size=4", "trainer.eval_samples=2",
            "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu",
            "trainer.max_steps=2", *LORA]


def test_wan_sp2_equals_one_process_ti2v_and_two_experts(tmp_path):
    ti2v = build_wan_fixture(tmp_path / "ti2v", "wan2.2-ti2v")
    a14b = build_wan_fixture(tmp_path / "a14b", "wan2.1", boundary_ratio=0.875)
    runs = {"ti2v": wan_args(ti2v, 9, 96, 32),
            "a14b": wan_args(a14b, 1, 48, 16) + ["actor.gradient_checkpointing=true"]}
    # the sp2 launch (two one-thread ranks) runs while this process trains the one-process references at one thread
    with start_many([args + FSDP + ["parallel.sp=2", f"trainer.output_dir={tmp_path / name / 'sp2'}"]
                     for name, args in runs.items()], tmp_path, nproc=2) as launch:
        for name, args in runs.items():
            run_cli(args + [f"trainer.output_dir={tmp_path / name / 'one'}"], tmp_path)
        out = launch.wait(timeout=900)
    assert out.returncode == 0, out.stderr[-6000:]
    for name in runs:
        assert_same(tmp_path / name / "one", tmp_path / name / "sp2", [0, 1, 2], ADAPTER)
        first = metrics(tmp_path / name / "one")
        assert first[1]["grad_norm"] > 0 and first[1]["kl"] > 0 and "eval/reward_mean" in first[0]
    # both experts were trained (their LoRA B matrices start at 0: only a gradient moves them)
    state = load_file(str(tmp_path / "a14b" / "sp2" / "checkpoints" / "step_000002" / ADAPTER))
    for expert in ("transformer", "transformer_2"):
        assert any(v.abs().sum() > 0 for k, v in state.items() if k.startswith(expert + ".") and "lora_B" in k), expert


@pytest.mark.parametrize("keys, message", [
    (["parallel.tp=2"], "parallel.tp=2: model.name=wan has no tensor-parallel plan"),
    (["parallel.sp=2", "model.compile=blocks"], "parallel.sp=2 with model.compile=blocks"),
])
def test_wan_plan_is_accepted_for_sp_only(tiny_wan_dir, shape_prompts_file, monkeypatch, keys, message):
    """sp=2 is accepted for Wan (both experts share the plan; the tiny model's 2 heads split over 2 ranks); tp and
    sp with torch.compile are config errors."""
    from polyrl.config import ConfigError, load_config
    from polyrl.distributed.plan import model_plans
    from polyrl.models.wan import WAN_PARALLEL_PLAN, WanPolicy

    base = ["model=wan", f"model.path={tiny_wan_dir}", f"data.path={shape_prompts_file}", "actor.backend=fsdp2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config(base + ["parallel.sp=2"]).parallel.sp == 2
    assert model_plans(WanPolicy) == {"transformer": WAN_PARALLEL_PLAN, "transformer_2": WAN_PARALLEL_PLAN}
    with pytest.raises(ConfigError) as e:
        load_config(base + keys)
    assert message in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "4")  # 4 ranks of sp would split the tiny model's 2 heads
    with pytest.raises(ConfigError) as e:
        load_config(base + ["parallel.sp=4"])
    assert "does not divide the model's 2 attention heads" in str(e.value)


def test_split_inputs_and_tuple_outputs_pad_one_stream_alike():
    """The plan's `split_inputs` (arguments by position or keyword) and tuple outputs (a rotary (cos, sin)) split into
    one stream, padded alike; a per-sample (B,) tensor passes whole; unequal lengths in one stream are an error."""
    from polyrl.distributed.ulysses import SequenceShards, _split_arguments_hook, _split_tokens

    class Block(torch.nn.Module):
        def forward(self, hidden_states, timestep=None):
            return hidden_states

    shards = SequenceShards(None, size=2, rank=1)
    hook = _split_arguments_hook(Block(), {"hidden_states": "video", "timestep": "video"}, shards)
    x, t = torch.arange(2 * 5 * 3.0).view(2, 5, 3), torch.arange(10.0).view(2, 5)
    (mine,), kwargs = hook(None, (x,), {"timestep": t})
    assert shards.lengths["video"] == (5, 6) and mine.shape == (2, 3, 3) and kwargs["timestep"].shape == (2, 3)
    torch.testing.assert_close(mine[:, :2], x[:, 3:])
    assert mine[:, 2].abs().sum() == 0 and kwargs["timestep"][:, 2].abs().sum() == 0  # the pad, last on rank 1
    per_sample = torch.tensor([700.0, 300.0])
    assert hook(None, (x, per_sample), {})[0][1] is per_sample
    cos, sin = _split_tokens(shards, "video", (torch.ones(1, 5, 1, 4), torch.ones(1, 5, 1, 4)))
    assert cos.shape == sin.shape == (1, 3, 1, 4) and cos[0, 2].abs().sum() == 0
    with pytest.raises(ValueError, match="split with 4 tokens here but 5 earlier"):
        shards.split("video", torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match=r"has no argument \['temb'\]"):
        _split_arguments_hook(Block(), {"temb": "video"}, shards)
