"""SD3's copy-free joint attention (models/sd3.py `JointAttention`) computes what diffusers' JointAttnProcessor2_0
computes: outputs and gradients of a whole transformer in float64, with q/k RMS norms, SD3.5's dual attention
(self-attention on image tokens only) and the last block's context_pre_only."""

import copy

import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.attention_processor import JointAttnProcessor2_0

from polyrl.models.sd3 import JointAttention, use_joint_attention


def _transformer() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=3,
        joint_attention_dim=12, caption_projection_dim=24, pooled_projection_dim=10, out_channels=4,
        pos_embed_max_size=8, dual_attention_layers=(0, 1), qk_norm="rms_norm",
    ).double()


def _inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64),
                encoder_hidden_states=torch.randn(2, 5, 12, generator=g, dtype=torch.float64),
                pooled_projections=torch.randn(2, 10, generator=g, dtype=torch.float64),
                timestep=torch.tensor([100.0, 700.0], dtype=torch.float64))


def _loss_and_grads(model, inputs):
    model.zero_grad()
    out = model(**inputs).sample
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_joint_attention_equals_diffusers_processor_in_outputs_and_gradients():
    reference = _transformer()
    assert {type(p) for p in reference.attn_processors.values()} == {JointAttnProcessor2_0}
    ours = copy.deepcopy(reference)
    use_joint_attention(ours)
    assert {type(p) for p in ours.attn_processors.values()} == {JointAttention}
    assert any(name.endswith("attn2.processor") for name in ours.attn_processors)  # the dual blocks are covered
    inputs = _inputs()
    out_ref, grads_ref = _loss_and_grads(reference, inputs)
    out, grads = _loss_and_grads(ours, inputs)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-12, msg=name)


def test_the_sd3_adapter_uses_it(tiny_sd3_dir):
    from omegaconf import OmegaConf


    cfg = OmegaConf.create({"path": str(tiny_sd3_dir), "dtype": "float32", "compile": "none", "max_sequence_length": 16})
    from polyrl.models.base import MODELS

    policy = MODELS.build("sd3", cfg, torch.device("cpu"))
    assert {type(p) for p in policy.transformer.attn_processors.values()} == {JointAttention}


def _with_lora(model):
    from polyrl.actor.local import add_lora
    from polyrl.models.sd3 import SD3_LORA_TARGETS

    add_lora(model, 2, 4, SD3_LORA_TARGETS)
    g = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_" in name:  # B starts at zero: make every adapter change its layer's output
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3
    return model


def test_lora_q_k_v_as_one_matmul_equal_peft_per_layer_in_outputs_and_gradients():
    """With LoRA on q/k/v, JointAttention runs the three A matrices as one matmul (models/shared_input_lora.py):
    the same outputs and gradients (LoRA weights included) as diffusers' processor calling each PEFT layer, float64;
    with the adapters disabled both give the base model."""
    import polyrl.models.shared_input_lora as shared

    reference = _with_lora(_transformer())
    ours = copy.deepcopy(reference)
    use_joint_attention(ours)
    fused = []
    vanilla = shared._vanilla_adapter
    shared._vanilla_adapter = lambda layers: fused.append(vanilla(layers)) or fused[-1]
    try:
        inputs = _inputs()
        out_ref, grads_ref = _loss_and_grads(reference, inputs)
        out, grads = _loss_and_grads(ours, inputs)
        # the image and text q/k/v of each of the 3 joint attentions took the fused path; the dual blocks' attn2
        # (no LoRA: the targets name `attn.` only) ran each layer as it is
        assert fused.count("default") == 2 * 3 and fused.count(None) == 2 and len(fused) == 8
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
        assert grads.keys() == grads_ref.keys() and any("lora_A" in n for n in grads)
        for name in grads:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-12, msg=name)
        fused.clear()
        for model in (reference, ours):
            model.disable_adapters()
        base = _transformer()
        use_joint_attention(base)
        with torch.no_grad():
            off, off_ref, plain = (m(**inputs).sample for m in (ours, reference, base))
        assert set(fused) == {None}  # disabled adapters: each layer's own forward
        torch.testing.assert_close(off, plain, rtol=0, atol=1e-12)
        torch.testing.assert_close(off_ref, plain, rtol=0, atol=1e-12)
    finally:
        shared._vanilla_adapter = vanilla
