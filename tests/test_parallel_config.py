"""The parallel layout is checked before any process group exists: each wrong combination is one config error line
naming the keys. And the pieces of the layout that need no second process: the mesh degrees, the order of the
sequence-parallel key mask, the sharded gradient clip on plain tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from polyrl.config import ConfigError, load_config
from polyrl.distributed.dims import ParallelDims, resolve_dims
from polyrl.distributed.fsdp2 import clip_grad_norm
from polyrl.distributed.ulysses import SequenceShards


@pytest.fixture
def base(tiny_sd3_dir, shape_prompts_file):
    return [f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}"]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    return str(e.value)


@pytest.mark.parametrize("world, keys, message", [
    (1, ["parallel.sp=2"], "world size 1 is not a multiple of parallel.dp_replicate × parallel.sp × parallel.tp = "
                           "1 × 2 × 1 = 2"),
    (2, ["parallel.dp_shard=2", "parallel.sp=2"], "world size 2 != parallel.dp_replicate × parallel.dp_shard × "
                                                  "parallel.sp × parallel.tp = 1 × 2 × 2 × 1 = 4"),
    (1, ["parallel.dp_shard=2"], "launch with `torchrun --nproc-per-node=N -m polyrl train ...`"),
    # the tiny SD3 has 2 heads: sp and tp each split them
    (4, ["parallel.sp=2", "parallel.tp=2"], "parallel.sp × parallel.tp = 2 × 2 = 4 does not divide the model's 2 "
                                             "attention heads"),
    (2, ["parallel.dp_shard=0"], "parallel.dp_shard=0 must be >= 1, or -1"),
    (2, ["parallel.tp=0"], "parallel.tp=0 must be >= 1"),
    (2, ["parallel.sp=2", "model.compile=blocks"], "parallel.sp=2 with model.compile=blocks"),
    (1, ["model.fp8=true"], "model.fp8=true with actor.backend=fsdp2"),
    (1, ["recipe=causal_lm_grpo"], "actor.backend=fsdp2 trains diffusion policies; model.name=causal_lm is a tokens"),
])
def test_wrong_layouts_are_config_errors_naming_the_keys(base, monkeypatch, world, keys, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert message in _error(base + ["actor.backend=fsdp2", *keys])
    assert not dist.is_initialized()


def test_sharding_keys_need_the_fsdp2_backend_and_a_model_plan(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "parallel.sp=2 needs actor.backend=fsdp2" in _error(base + ["parallel.sp=2"])
    assert "parallel.dp_replicate=2 needs actor.backend=fsdp2" in _error(base + ["parallel.dp_replicate=2"])
    # a model class without a parallel plan: FLUX
    flux = _error(base + ["model=flux", "actor.backend=fsdp2", "parallel.sp=2"])
    assert "parallel.sp=2: model.name=flux has no parallel plan" in flux
    # what is allowed: plain data parallel with the local backend, sharding without a plan, the SD3 plan
    assert load_config(base).parallel.sp == 1
    assert load_config(base + ["model=flux", "actor.backend=fsdp2", "parallel.dp_shard=2"]).parallel.dp_shard == 2
    assert load_config(base + ["actor.backend=fsdp2", "parallel.tp=2"]).parallel.tp == 2


def test_cli_prints_one_line_and_starts_no_process_group(base, capsys, monkeypatch):
    from polyrl.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", *base, "actor.backend=fsdp2", "parallel.sp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyrl: config error: world size 1 ")
    assert not dist.is_initialized()


def test_layout_degrees():
    class P(dict):
        pass

    dims = resolve_dims(P(dp_replicate=2, dp_shard=-1, sp=2, tp=1), "fsdp2", 8, "m", {"sequence": True}, heads=4)
    assert (dims.dp, dims.dp_shard, dims.sp, dims.tp, dims.mesh_shape) == (4, 2, 2, 1, (2, 2, 2, 1))
    assert resolve_dims(P(dp_replicate=1, dp_shard=-1, sp=1, tp=1), "local", 3) == ParallelDims(dp=3)
    assert ParallelDims(dp=4, dp_replicate=2, tp=2).world_size == 8 and not ParallelDims().sp_enabled


def test_key_mask_is_in_the_all_to_all_order():
    """Rank r's tokens arrive as [image_r, text_r]: with 81 image and 31 text tokens over 2 ranks (shares 41 and 16)
    the two pads are the last image token of rank 1 (index 41+16+40) and its last text token (41+16+41+15)."""
    shards = SequenceShards(None, size=2, rank=0)
    shards.lengths = {"image": (81, 82), "text": (31, 32)}
    valid = shards.key_mask(["image", "text"], "cpu")
    assert valid.shape == (114,) and torch.nonzero(~valid).flatten().tolist() == [97, 113]
    assert shards.key_mask(["image"], "cpu").logical_not().nonzero().flatten().tolist() == [81]
    shards.lengths = {"image": (64, 64), "text": (32, 32)}
    assert shards.key_mask(["image", "text"], "cpu") is None  # nothing padded: no mask (the fast kernels)


def test_split_pads_to_a_multiple_of_sp_and_keeps_this_ranks_share():
    shards = SequenceShards(None, size=2, rank=1)
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    mine = shards.split("text", x)
    assert shards.lengths["text"] == (5, 6) and mine.shape == (2, 3, 3)
    torch.testing.assert_close(mine[:, :2], x[:, 3:])
    assert torch.equal(mine[:, 2], torch.zeros(2, 3))


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm(a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in a]))) == pytest.approx(0.5, rel=1e-5)
