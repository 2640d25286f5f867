"""How the streams of a token policy's response weigh in its loss (a speaking policy's text and speech tokens,
docs/tokens.md "Speaking omni models"): per-token weights w_t that multiply each token's loss, as a rollout-correction
weight does (token_losses.py), so that every token loss (GRPO, DAPO, GSPO, OPD, and DPO's sequence sums) takes them.

    token  (actor.stream_norm=token):   w_t = c_{s(t)}
    stream (actor.stream_norm=stream):  w_t = n_b · c_{s(t)} / (n_{b,s(t)} · Σ_{s present in b} c_s)

with c_s the stream's coefficient (`actor.stream_weights`, default 1), n_b the response's tokens and n_{b,s} those of
stream s. `stream` makes each stream's tokens of a response weigh, together, its coefficient's share of the response:
under GRPO's sequence mean the response's loss is Σ_s c_s · mean_{t ∈ s} ℓ_t / Σ_s c_s (each stream's token mean,
whatever its length: 16 codes per 80 ms of speech against a few text tokens), and the weights of a response still sum
to n_b, so the normalisation of every aggregation is unchanged.
"""

from __future__ import annotations

import torch

STREAM_NORMS = ("token", "stream")


def stream_token_weights(stream: torch.Tensor, mask: torch.Tensor, coefs: torch.Tensor, norm: str) -> torch.Tensor:
    """w (B, R) float from the stream index of each response token `stream` (B, R) long, the response `mask` (B, R)
    and the streams' coefficients `coefs` (S,) (module docstring); 0 on padding."""
    m = mask.to(coefs.dtype)
    c = coefs[stream] * m
    if norm == "token":
        return c
    if norm != "stream":
        raise ValueError(f"actor.stream_norm={norm!r}; allowed: {', '.join(STREAM_NORMS)}")
    counts = torch.stack([((stream == s).to(m) * m).sum(-1) for s in range(len(coefs))], -1)  # (B, S)
    present = (counts > 0).to(coefs.dtype) * coefs  # (B, S)
    total = present.sum(-1, keepdim=True)
    per_stream = torch.where(counts > 0, m.sum(-1, keepdim=True) * coefs / (counts.clamp(min=1) * total.clamp(min=1e-30)),
                             torch.zeros_like(counts))  # (B, S) the weight of each token of stream s in row b
    return per_stream.gather(-1, stream) * m
