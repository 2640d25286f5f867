"""FP8 base-weight matmuls (perf/fp8.py): values and input gradients against float64, and the swap rules."""

import pytest
import torch

from polyrl.perf.fp8 import E4M3, FP8Linear, apply_fp8, quantize_rows


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def test_quantize_rows_round_trip_and_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-3, 3, 40).unsqueeze(1)  # rows of very different size
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.shape == (40, 1)
    assert float(q.float().abs().amax(dim=1).min()) == pytest.approx(448.0)  # each row uses the full range
    assert _rel(q.float() * scale, x) < 0.04  # 3 mantissa bits: ≤ 2^-4 relative per element


@pytest.mark.parametrize("rows", [32, 37])  # 37: not a multiple of 16, padded inside
def test_fp8_linear_matches_float64_values_and_input_gradient(rows):
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(256, 512).requires_grad_(False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=g)
    x = torch.randn(2, rows, 256, generator=g, dtype=torch.float64)
    fp8 = FP8Linear(lin)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    y = fp8(xb)
    assert y.shape == (2, rows, 512) and y.dtype == torch.bfloat16
    y_ref = x @ lin.weight.double().t() + lin.bias.double()
    assert _rel(y, y_ref) < 0.06
    grad_out = torch.randn(2, rows, 512, generator=g, dtype=torch.float64)
    y.backward(grad_out.to(torch.bfloat16))
    grad_ref = grad_out @ lin.weight.double()  # dL/dx = dL/dy · W
    assert _rel(xb.grad, grad_ref) < 0.08
    assert not any(p.requires_grad for p in fp8.parameters())


def test_apply_fp8_swaps_only_frozen_wide_linears():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8), torch.nn.Linear(8, 256))
    model.requires_grad_(False)
    trainable = torch.nn.Linear(256, 256)  # e.g. a full fine-tune or a LoRA matrix: stays
    model.append(trainable)
    assert apply_fp8(model) == 1
    assert isinstance(model[0], FP8Linear) and type(model[2]) is torch.nn.Linear and model[4] is trainable


def test_fp8_transformer_is_consistent_between_rollout_and_training_passes():
    """The rollout (no grad) and the training forward run the same kernels: identical velocities, so the first
    PPO ratio is exactly 1; the FP8 model stays within a few percent of the bf16 one."""
    from diffusers import SD3Transformer2DModel

    from polyrl.actor.local import add_lora
    from polyrl.models.sd3 import SD3_LORA_TARGETS

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64,
                                  num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=256,
                                  pooled_projection_dim=256, out_channels=4, pos_embed_max_size=8).to(torch.bfloat16)
    add_lora(model, 4, 4, SD3_LORA_TARGETS)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8).bfloat16(), timestep=torch.tensor([500.0, 200.0]),
                  encoder_hidden_states=torch.randn(2, 8, 256).bfloat16(), pooled_projections=torch.randn(2, 256).bfloat16(),
                  return_dict=False)
    with torch.no_grad():
        reference = model(**inputs)[0]
    assert apply_fp8(model) > 0
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora" in n)
    with torch.no_grad():
        rollout_v = model(**inputs)[0]
    train_v = model(**inputs)[0]
    assert torch.equal(rollout_v, train_v.detach())
    assert _rel(rollout_v, reference) < 0.1
    train_v.float().square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def test_fp8_needs_lora():
    from polyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.fp8=true quantizes the frozen base weights, so it needs LoRA"):
        load_config(["model.fp8=true", "actor.lora_rank=0"])


@pytest.mark.parametrize("capability, lora, sharded, dtype, expected", [
    ((9, 0), True, False, "bfloat16", True),    # Hopper, a bf16 LoRA run on the local actor: on
    ((8, 9), True, False, "float16", True),     # Ada has float8 tensor cores too
    ((8, 0), True, False, "bfloat16", False),   # Ampere has none
    ((9, 0), False, False, "bfloat16", False),  # a full fine-tune trains the base: nothing frozen to quantize
    ((9, 0), True, True, "bfloat16", False),    # a sharded actor: FP8 base layers are not sharded here
    ((9, 0), True, False, "float32", False),    # a float32 network: the run asked for precision
])
def test_fp8_auto_turns_on_only_where_it_runs_and_pays(monkeypatch, capability, lora, sharded, dtype, expected):
    from polyrl.perf.fp8 import resolve_fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    run = dict(lora=lora, sharded=sharded, dtype=dtype)
    assert resolve_fp8("auto", torch.device("cuda", 0), **run) is expected
    assert resolve_fp8("auto", torch.device("cpu"), **run) is False
    for setting in (True, False):  # an explicit choice stands
        assert resolve_fp8(setting, torch.device("cuda", 0), **run) is setting


@pytest.mark.parametrize("key", ["model.fp8", "rollout.training_graph"])
def test_auto_switches_refuse_other_values(key):
    from polyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{key}='sometimes' is not valid; allowed: True, False, auto"):
        load_config([f"{key}=sometimes"])


def test_auto_switches_are_decided_by_the_run_and_recorded(tmp_path, capsys):
    """On this CPU `model.fp8=auto` is off; `rollout.training_graph=auto` is on for a compiled model whose sampling
    calls have the training micro-batch's size (exact, and no activations beyond training's), off otherwise. The run's
    config.yaml records what was decided, and the unequal-sizes warning is for an explicit `true` only."""
    from omegaconf import OmegaConf

    from polyrl.config import load_config
    from polyrl.trainer.loop import Trainer

    for compile_mode, call, graph in (("none", 4, False), ("blocks", 8, False), ("blocks", 4, True)):
        out = tmp_path / f"{compile_mode}{call}"
        cfg = load_config([f"model.compile={compile_mode}", f"rollout.batch_size={call}", "actor.micro_batch_size=4",
                           f"trainer.output_dir={out}", "trainer.progress=false", "model.compile_cache=null"])
        assert cfg.model.fp8 == "auto" and cfg.rollout.training_graph == "auto"
        Trainer(cfg).close()
        saved = OmegaConf.load(out / "config.yaml")
        assert (saved.model.fp8, saved.rollout.training_graph) == (False, graph), (compile_mode, call)
        err = capsys.readouterr().err
        assert "rollout.training_graph" not in err
        # a compiled run without a saved cache says why its first step is slow
        assert ("polyrl: model.compile=blocks: the first step also compiles the networks (minutes unless torch's own "
                "cache holds them); the graphs are not saved (model.compile_cache=null)" in err) == (compile_mode == "blocks")


def test_compiled_fp8_graphs_enter_the_compile_cache():
    """The FP8 matmul is a registered op, not a torch.autograd.Function, which AOTAutograd's cache refuses: an FP8
    graph compiled forward and backward is saved to (or found in) the cache, so a compile cache holds FP8 runs too
    (docs/performance.md). Values and input gradient equal the eager layer's."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(256, 256).requires_grad_(False)
    layer = FP8Linear(lin)
    x = torch.randn(32, 256, generator=g).bfloat16()
    eager_x = x.clone().requires_grad_(True)
    eager = layer(eager_x)
    eager.float().square().sum().backward()
    torch._dynamo.reset()
    counters.clear()
    compiled_x = x.clone().requires_grad_(True)
    compiled = torch.compile(layer)(compiled_x)
    compiled.float().square().sum().backward()
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0 and aot["autograd_cache_saved"] + aot["autograd_cache_hit"] == 1, dict(aot)
    assert _rel(compiled, eager) < 1e-2 and _rel(compiled_x.grad, eager_x.grad) < 1e-2
