"""The analytic MM-DiT FLOP count against a count of what the model actually executes."""

import pytest
import torch
from diffusers import SD3Transformer2DModel

from polyrl.models.sd3 import sd3_forward_flops
from polyrl.perf.flops import epoch_flops


def executed_flops(model: torch.nn.Module, inputs: dict) -> tuple[float, int]:
    """2·(output elements)·(fan-in) for every Linear/Conv2d call, 4·B·Sq·Sk·(H·D) for every attention call."""
    total = [0.0, 0]

    def on_linear(mod, args, out):
        fan_in = mod.in_features if isinstance(mod, torch.nn.Linear) else mod.in_channels * mod.kernel_size[0] * mod.kernel_size[1]
        total[0] += 2.0 * out.numel() * fan_in

    handles = [m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(q, k, v, *a, **kw):
        b, h, sq, dh = q.shape
        total[0] += 4.0 * b * sq * k.shape[2] * h * dh
        total[1] += 1
        return sdpa(q, k, v, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = counting_sdpa
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for h in handles:
            h.remove()
    return total[0], total[1]


@pytest.mark.parametrize("dual", [(), (0, 1)])
def test_sd3_flops_match_executed_ops(dual):
    torch.manual_seed(0)
    cfg = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
               joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
               pos_embed_max_size=8, dual_attention_layers=dual, qk_norm="rms_norm")
    model = SD3Transformer2DModel(**cfg).eval()
    batch, text = 3, 7
    inputs = dict(hidden_states=torch.randn(batch, 4, 8, 8), encoder_hidden_states=torch.randn(batch, text, 24),
                  pooled_projections=torch.randn(batch, 12), timestep=torch.full((batch,), 500.0))
    executed, attention_calls = executed_flops(model, inputs)
    assert attention_calls == 3 + len(dual)
    image_tokens = (8 // 2) ** 2
    assert sd3_forward_flops(model.config, image_tokens, text) * batch == pytest.approx(executed, rel=1e-12)


def test_sd35_medium_forward_is_2_23_tflop():
    """docs/benchmark.md: 2.23 TFLOP per forward per sample at 512² (1024 image tokens) + 205 text tokens."""
    from types import SimpleNamespace

    c = SimpleNamespace(num_attention_heads=24, attention_head_dim=64, num_layers=24, dual_attention_layers=range(13),
                        patch_size=2, in_channels=16, out_channels=16, joint_attention_dim=4096, pooled_projection_dim=2048)
    f = sd3_forward_flops(c, 1024, 205)
    assert f == pytest.approx(2.2237e12, rel=1e-4)
    # one epoch: 64 images, 10 CFG sampling steps, 9 trained CFG steps with a KL reference forward ≈ 13 PFLOP
    assert epoch_flops(f, 64, 10, 9, cfg=True, reference_forward=True) == pytest.approx(f * 128 * (10 + 9 * 4))
    assert epoch_flops(f, 64, 10, 9, cfg=True, reference_forward=True) / 1e15 == pytest.approx(13.09, abs=0.01)
