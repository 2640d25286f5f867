"""Performance knobs change no result: sampling/training batch sizes and regional compilation (issue 5 item 4).

Tolerances: batch sizes only regroup float32 matmuls (rounding, ≤ 1e-5 relative on log-probs and losses);
compiled vs eager float32 graphs fuse elementwise ops (≤ 1e-5 relative on the velocity)."""

import json

import pytest
import torch
from test_cli_train import _common  # noqa: E402  (tests are a rootdir of modules)

from polyrl.cli.main import main
from polyrl.perf.compile import compile_transformer


class MeanBrightness:
    """A smooth reward (JPEG sizes jump by whole bytes on a rounding-level change of the image)."""

    def __init__(self, **unused):  # takes (and ignores) the jpeg reward group's keys the test command selects
        pass

    def __call__(self, images, prompts, metadata):
        from polyrl.rewards import RewardOutput

        return RewardOutput(images.mean(dim=(1, 2, 3)))


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_batch_sizes_change_no_number(tiny_sd3_dir, shape_prompts_file, tmp_path):
    from polyrl.rewards import REWARDS

    REWARDS.setdefault("test_mean_brightness", MeanBrightness)
    # Flow-GRPO with a KL term (recipe=toy_flow_grpo; the default recipe is DiffusionNFT): log-probs, ratios and KL
    extra = ["recipe=toy_flow_grpo", "trainer.eval_every=0", "trainer.save_every=0", "algorithm.kl_beta=0.04",
             "trainer.deterministic=true", "reward.name=test_mean_brightness"]
    big, small = tmp_path / "big", tmp_path / "small"
    assert main(_common(tiny_sd3_dir, shape_prompts_file, big, 2, extra + ["rollout.batch_size=4"])) == 0
    assert main(_common(tiny_sd3_dir, shape_prompts_file, small, 2,
                        extra + ["rollout.batch_size=1", "actor.micro_batch_size=1"])) == 0
    for a, b in zip(_rows(big), _rows(small), strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-5)
        for key in ("ratio_mean", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key
        # loss ≈ −mean(A)·ρ + β·KL with mean(A) = 0: a sum that cancels, so its tolerance is absolute
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)


def test_regional_compile_matches_eager(tiny_sd3_dir):
    from omegaconf import OmegaConf

    from polyrl.actor.local import add_lora
    from polyrl.models import build_model

    cfg = OmegaConf.create({"name": "sd3", "path": str(tiny_sd3_dir), "dtype": "float32", "max_sequence_length": 16})
    adapter = build_model(cfg, torch.device("cpu"))
    add_lora(adapter.transformer, 4, 4, adapter.default_lora_targets)
    for name, p in adapter.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # non-zero LoRA, so the adapter path is exercised
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 16, 16, generator=g)  # tiny pipeline: 4 latent channels, 32x32 images
    sigma = torch.tensor([0.9, 0.5, 0.2])
    cond = adapter.encode_prompts(["a green triangle", "three yellow squares", "a blue circle"])
    shared = adapter.encode_prompts([""])
    eager = adapter.velocity({"x": x}, sigma, cond, shared, 3.0)["x"]
    compile_transformer(adapter.transformer, "blocks")
    compiled = adapter.velocity({"x": x}, sigma, cond, shared, 3.0)["x"]
    assert torch.linalg.vector_norm(compiled - eager) / torch.linalg.vector_norm(eager) < 1e-5


def test_compiled_vae_decoder_matches_eager(tiny_sd3_dir):
    """model.compile also compiles the SD3 VAE decoder (models/sd3.py): same images to float32 rounding."""
    from omegaconf import OmegaConf

    from polyrl.models import build_model

    base = {"name": "sd3", "path": str(tiny_sd3_dir), "dtype": "float32", "max_sequence_length": 16}
    eager = build_model(OmegaConf.create({**base, "compile": "none"}), torch.device("cpu"))
    compiled = build_model(OmegaConf.create({**base, "compile": "blocks"}), torch.device("cpu"))
    assert compiled.vae.decoder._compiled_call_impl is not None
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    a, b = eager.decode({"x": z})["images"], compiled.decode({"x": z})["images"]
    assert a.shape == (2, 3, 32, 32)
    assert (a - b).abs().max() < 1e-5


def test_training_graph_makes_the_compiled_rollout_equal_training():
    """rollout.training_graph's reason and its effect on a compiled LoRA SD3 transformer (bf16 autocast, per-block
    compile): the rollout's usual call (eval mode, no autograd) runs a twin graph whose fusions round differently from
    training's (train mode, autograd on); the call made `as_in_training` runs training's graph and equals it bit for
    bit, and leaves the network in eval mode and autograd off."""
    from types import SimpleNamespace

    from diffusers import SD3Transformer2DModel

    from polyrl.actor.local import add_lora
    from polyrl.models.sd3 import SD3_LORA_TARGETS, use_joint_attention
    from polyrl.sampling.diffusion import as_in_training

    torch.manual_seed(0)
    net = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                pooled_projection_dim=16, out_channels=4, dual_attention_layers=())
    use_joint_attention(net)
    add_lora(net, 4, 8.0, SD3_LORA_TARGETS)
    for name, p in net.named_parameters():
        p.data = p.data.float() if p.requires_grad else p.data.bfloat16()  # bf16 frozen base, float32 LoRA masters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    compile_transformer(net, "blocks")
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(4, 4, 8, 8, generator=g).bfloat16(),
                  timestep=torch.rand(4, generator=g) * 1000,
                  encoder_hidden_states=torch.randn(4, 6, 32, generator=g).bfloat16(),
                  pooled_projections=torch.randn(4, 16, generator=g).bfloat16())

    def velocity():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(**inputs, return_dict=False)[0]

    net.train()
    training = velocity().detach()  # the actor's forward: train mode, autograd on
    net.eval()
    with torch.no_grad():
        twin = velocity()
        with as_in_training(SimpleNamespace(modules=lambda: {"transformer": net})):
            sampled = velocity()
        assert not net.training and not torch.is_grad_enabled()  # the rollout's state, restored
    assert not torch.equal(twin, training), "the no-grad twin graph now rounds as training's: the setting is moot"
    assert torch.equal(sampled.detach(), training)


def test_next_steps_noise_is_drawn_during_the_update_with_the_same_numbers(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                           monkeypatch):
    """Steps after the first take their rollout noise from the draw started on the worker thread while the previous
    step trained (sampling/base.py DrawAhead); a run that draws every step in place logs the same numbers."""
    import threading

    import polyrl.sampling.diffusion as loop
    from polyrl.rewards import REWARDS

    REWARDS.setdefault("test_mean_brightness", MeanBrightness)
    threads = []
    draw = loop.draw_noise

    def recorded(*args, **kwargs):
        threads.append((args[-1], threading.current_thread().name))
        return draw(*args, **kwargs)

    monkeypatch.setattr(loop, "draw_noise", recorded)
    extra = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.deterministic=true",
             "reward.name=test_mean_brightness"]
    ahead, in_place = tmp_path / "ahead", tmp_path / "in_place"
    assert main(_common(tiny_sd3_dir, shape_prompts_file, ahead, 3, extra)) == 0
    assert [(step, name.startswith("polyrl-draws")) for step, name in threads] == [(0, False), (1, True), (2, True)]
    threads.clear()
    monkeypatch.setattr(loop.DrawAhead, "start", lambda self, key, draw: None)
    assert main(_common(tiny_sd3_dir, shape_prompts_file, in_place, 3, extra)) == 0
    assert [name.startswith("polyrl-draws") for _, name in threads] == [False, False, False]
    for a, b in zip(_rows(ahead), _rows(in_place), strict=True):
        for key in ("reward/mean", "loss", "grad_norm"):
            assert a[key] == b[key], key
