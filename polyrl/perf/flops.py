"""Analytic model FLOPs (docs/algorithms.md §6). Each model file counts its own forward (`sd3_forward_flops` in
models/sd3.py, ...); this module holds what is model-independent.

Convention: a matmul with a (tokens × in) input and an (in × out) weight is 2·tokens·in·out; joint self-attention
over a sequence of S tokens at width d is 4·S²·d (QKᵀ and AV); per-sample layers (timestep / pooled-text
modulation) count once per sample, not per token. Elementwise work (norms, activations, biases) is not counted.
Training counts 3× a forward (forward + backward), forward-only passes 1×; CFG doubles the batch (the caller
multiplies by the batch it actually ran).
"""

from __future__ import annotations


def epoch_flops(forward: float, images: int, sampling_steps: int, trained_steps: int, cfg: bool,
                reference_forward: bool, old_forward: bool = False) -> float:
    """Model FLOPs of one Flow-GRPO-style epoch: sampling + training (3×) + KL-reference and old-policy passes (1×)."""
    batch = images * (2 if cfg else 1)
    per_trained = 3 + int(reference_forward) + int(old_forward)
    return forward * batch * (sampling_steps + trained_steps * per_trained)

