"""The actor of a token policy: `LocalActor`'s weights, optimiser, policy contexts and update loop, with token
re-scoring as its evaluator (`algorithms.token_losses.TokenEvaluator`) and rollout correction per token (§4).

A policy whose responses hold several streams (`token_streams`, `streams`: a speaking policy's text and speech) has
its tokens weighed by stream (`actor.stream_weights`, `actor.stream_norm`; algorithms/streams.py): the weights join
each token's rollout-correction weight, and DPO's sequence log-probs are the weighted sums.

Rollout correction on tokens is the diffusion one with a response token in place of a trained step: `bypass` uses
the rollout's per-token log-probs as log π_old (no old-policy forward); `recompute` and `decoupled` run one
teacher-forced forward of the old policy (timed as `time/old_logprob`), `decoupled` adds truncated importance
weights × the rejection mask per token; `log_ratio_bounds` masks tokens whose log-ratio leaves the bounds.
"""

from __future__ import annotations

import torch

from ..algorithms.streams import stream_token_weights
from ..algorithms.token_losses import TokenScores
from ..batch import Rollout, TokenBatch
from ..sampling.tokens import TokenPlan, response_token_log_probs
from .local import LocalActor, correction_weights, in_bounds


class TokenActor(LocalActor):
    def _init_sampler(self, plan: TokenPlan) -> None:
        self.temperature = plan.log_prob_temperature
        names = tuple(getattr(self.adapter, "streams", ()))
        given = dict(getattr(self.cfg, "stream_weights", None) or {})
        self.stream_norm = getattr(self.cfg, "stream_norm", "token")
        self.stream_coefs = None  # None: every token weighs 1 (one stream, or the defaults)
        if names and (any(float(v) != 1.0 for v in given.values()) or self.stream_norm != "token"):
            self.stream_coefs = torch.tensor([float(given.get(n, 1.0)) for n in names])

    def stream_weights(self, tokens: TokenBatch, r: int) -> torch.Tensor | None:
        """The stream weights (B, r) of `tokens`' first r response positions (algorithms/streams.py), None when every
        token weighs 1."""
        if self.stream_coefs is None:
            return None
        dev = self.adapter.device
        ids = tokens.response_ids[:, :r].to(dev)
        return stream_token_weights(self.adapter.token_streams(ids), tokens.response_mask[:, :r].to(dev),
                                    self.stream_coefs.to(dev), self.stream_norm)

    def sequence_log_probs(self, batch: Rollout, tokens: TokenBatch, policy: str = "current") -> torch.Tensor:
        """Σ_t w_t log π(token t) (B,) over each response (DPO's sequence log-probs): w the stream weights, else 1."""
        lp = self.response_log_probs(batch, tokens, policy)
        w = self.stream_weights(tokens, lp.shape[1])
        return (lp if w is None else lp * w.to(lp)).sum(-1)

    # ------------------------------------------------------------------------------------ TokenEvaluator
    def response_log_probs(self, batch: Rollout, tokens: TokenBatch, policy: str = "current") -> torch.Tensor:
        """log π of `tokens`' response tokens (B, R') under `policy`, R' = the longest response (padding trimmed)."""
        with self.policy(policy):
            return response_token_log_probs(self.adapter, tokens.trimmed(), batch.cond, self.temperature)

    def token_scores(self, batch: Rollout, policy: str = "current") -> TokenScores:
        log_prob = self.response_log_probs(batch, batch.tokens, policy)
        r = log_prob.shape[1]
        dev = log_prob.device
        mask = batch.tokens.response_mask[:, :r].to(dev).float()
        old = (batch.old_log_probs if batch.old_log_probs is not None else batch.log_probs)[:, :r].to(dev)
        weight = None
        if policy == "current":
            weight = None if batch.step_weights is None else batch.step_weights[:, :r].to(dev)
            streams = self.stream_weights(batch.tokens, r)
            if streams is not None:
                weight = streams if weight is None else weight * streams
            if self.correction.mode == "bypass" and self.bounds is not None:
                keep = in_bounds(log_prob.detach() - batch.log_probs[:, :r].to(dev), self.bounds)
                n = mask.sum().clamp(min=1)
                self._masked.append((((1 - keep) * mask).sum() / n, int(n)))
                weight = keep if weight is None else weight * keep
        return TokenScores(log_prob, old, mask, weight)

    # ------------------------------------------------------------------------------------ rollout correction
    def old_forward(self, batch: Rollout, old_policy: str, micro: int) -> dict[str, list]:
        """`prepare_old`'s old-policy forward per response token (§4): fills `old_log_probs` (and `step_weights` for
        decoupled); returns the correction stats, averaged over response tokens."""
        old = torch.zeros_like(batch.log_probs)
        for part in torch.arange(len(batch)).split(micro):
            sub = batch.select(part)
            lp = self.response_log_probs(sub, sub.tokens, old_policy).float()
            old[part.to(old.device), : lp.shape[1]] = lp.to(old)
        batch.old_log_probs = old
        mask = batch.tokens.response_mask.to(old).float()
        n = int(mask.sum())
        delta = (old - batch.log_probs).abs() * mask
        stats = {"correction/abs_dlogp": [(delta.sum() / max(n, 1), n)], "correction/max_abs_dlogp": [(delta.max(), 1)]}
        if self.correction.mode == "decoupled":
            weight, keep = correction_weights(old, batch.log_probs, self.correction.is_cap, self.bounds)
            batch.step_weights = weight * keep * mask
            valid = mask.bool()
            stats.update({
                "correction/is_weight_mean": [((weight * mask).sum() / max(n, 1), n)],
                "correction/is_weight_max": [(weight[valid].max() if n else weight.new_ones(()), 1)],
                "correction/is_weight_min": [(weight[valid].min() if n else weight.new_ones(()), 1)],
                "correction/masked_frac": [(((1 - keep) * mask).sum() / max(n, 1), n)],
            })
        return stats
