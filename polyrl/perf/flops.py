"""Analytic model FLOPs of one transformer forward, per sample (ALGORITHMS.md §6).

Convention: a matmul with a (tokens × in) input and an (in × out) weight is 2·tokens·in·out; joint self-attention
over a sequence of S tokens at width d is 4·S²·d (QKᵀ and AV); per-sample layers (timestep / pooled-text
modulation) count once per sample, not per token. Elementwise work (norms, activations, biases) is not counted.
Training counts 3× a forward (forward + backward), forward-only passes 1×; CFG doubles the batch (the caller
multiplies by the batch it actually ran).
"""

from __future__ import annotations


def sd3_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """SD3 / SD3.5 MM-DiT (`SD3Transformer2DModel`), one sample with `image_tokens` patches and `text_tokens`.

    Per joint block: image stream q/k/v/out (4d²) + MLP (8d²) per image token, text stream the same per text
    token (the last block is context-pre-only: text q/k/v only), joint attention over N+T tokens; SD3.5's dual
    blocks add a second image-only attention (4d² per image token + 4·N²·d). Plus patch embedding, caption
    projection, output projection and the per-sample modulation linears.
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, layers = image_tokens, text_tokens, c.num_layers
    dual = set(getattr(c, "dual_attention_layers", ()) or ())
    p2 = c.patch_size**2
    per_sample = 2 * (256 * d + d * d + c.pooled_projection_dim * d + d * d)  # timestep + pooled-text embedders
    flops = 2 * n * c.in_channels * p2 * d + 2 * t * c.joint_attention_dim * d  # patchify, caption projection
    for i in range(layers):
        last = i == layers - 1
        image_params = 12 * d * d + (4 * d * d if i in dual else 0)
        text_params = (3 if last else 12) * d * d
        flops += 2 * n * image_params + 2 * t * text_params
        flops += 4 * (n + t) ** 2 * d + (4 * n * n * d if i in dual else 0)
        per_sample += 2 * d * ((9 if i in dual else 6) * d + (2 if last else 6) * d)  # AdaLN-Zero(-X) linears
    per_sample += 2 * d * 2 * d  # output AdaLayerNormContinuous
    flops += 2 * n * d * p2 * c.out_channels  # proj_out
    return float(flops + per_sample)


def qwen_image_forward_flops(config, image_tokens: int, text_tokens: int) -> float:
    """Qwen-Image dual-stream MM-DiT (`QwenImageTransformer2DModel`), one sample with `image_tokens` packed 2×2
    patches and `text_tokens` (padded) text tokens.

    Per block, each stream has its own q/k/v/out (4d²) and GELU MLP (d → 4d → d, 8d²) applied to its own tokens,
    and the joint attention runs over N+T tokens; the per-sample modulation linears are img_mod and txt_mod
    (d → 6d each). Plus img_in (4C → d), txt_in (joint → d), the timestep embedder (256 → d → d), the output
    AdaLayerNormContinuous (d → 2d) and proj_out (d → 4·C_out).
    """
    c = config
    d = c.num_attention_heads * c.attention_head_dim
    n, t, layers = image_tokens, text_tokens, c.num_layers
    p2 = c.patch_size**2
    per_sample = 2 * (256 * d + d * d) + 2 * d * 2 * d + layers * 2 * (2 * d * 6 * d)
    flops = 2 * n * c.in_channels * d + 2 * t * c.joint_attention_dim * d + 2 * n * d * p2 * c.out_channels
    flops += layers * (2 * (n + t) * 12 * d * d + 4 * (n + t) ** 2 * d)
    return float(flops + per_sample)


def epoch_flops(forward: float, images: int, sampling_steps: int, trained_steps: int, cfg: bool,
                reference_forward: bool, old_forward: bool = False) -> float:
    """Model FLOPs of one Flow-GRPO-style epoch: sampling + training (3×) + KL-reference and old-policy passes (1×)."""
    batch = images * (2 if cfg else 1)
    per_trained = 3 + int(reference_forward) + int(old_forward)
    return forward * batch * (sampling_steps + trained_steps * per_trained)


FORWARD_FLOPS = {"sd3": sd3_forward_flops, "qwen_image": qwen_image_forward_flops}
