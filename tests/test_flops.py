"""The analytic MM-DiT FLOP count against a count of what the model actually executes."""

import pytest
import torch
from diffusers import SD3Transformer2DModel
from flop_count import executed_flops

from polyrl.models.sd3 import sd3_forward_flops
from polyrl.perf.flops import epoch_flops


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
