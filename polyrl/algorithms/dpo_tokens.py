"""DPO and IPO for token policies (docs/algorithms.md §5): sequence log-probs (sums over response tokens, each
token weighed by its stream for a policy of several: `TokenEvaluator.sequence_log_probs`) of a chosen and a rejected
response under the policy and the frozen reference.

Offline (`data.pairs_path`: prompt / chosen / rejected texts, `polyrl/data/text_pairs.py`): a batch row is a pair,
its chosen response in `tokens` and its rejected one in `extras["rejected_tokens"]`. Online (no pairs file): the
best and the worst response of each group form a pair (groups whose rewards are all equal give none).
"""

from __future__ import annotations

import torch

from ..batch import Rollout
from .base import register_algorithm
from .diffusion_dpo import best_worst_pairs
from .token_losses import DPO_LOSSES, TokenAlgorithm, TokenEvaluator, dpo_loss


@register_algorithm("dpo")
class DPO(TokenAlgorithm):
    needs_reference = True
    uses_log_probs = False  # trains on sequence likelihoods, not on the rollout's log-probs
    trains_on_pairs = True

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", adv_std: str = "group",
                 adv_clip_max: float = 5.0):
        if loss_type not in DPO_LOSSES:
            raise ValueError(f"algorithm.loss_type={loss_type!r}; allowed: {', '.join(DPO_LOSSES)}")
        if beta <= 0:
            raise ValueError(f"algorithm.beta={beta} must be > 0")
        self.beta, self.loss_type = beta, loss_type
        self.adv_std, self.adv_clip_max = adv_std, adv_clip_max

    def prepare(self, batch: Rollout) -> Rollout:
        if "rejected_tokens" in batch.extras:  # offline pairs
            return batch
        win, lose = best_worst_pairs(batch.rewards, batch.group_ids)
        pairs = batch.select(win)
        pairs.extras["rejected_tokens"] = batch.tokens.select(lose)
        return pairs

    def step_loss(self, policy: TokenEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        rejected = batch.extras["rejected_tokens"]
        chosen = policy.sequence_log_probs(batch, batch.tokens)
        lost = policy.sequence_log_probs(batch, rejected)
        with torch.no_grad():
            ref_chosen = policy.sequence_log_probs(batch, batch.tokens, policy="reference")
            ref_lost = policy.sequence_log_probs(batch, rejected, policy="reference")
        per_pair, margin = dpo_loss(chosen, lost, ref_chosen, ref_lost, self.beta, self.loss_type)
        loss = per_pair.mean()
        stats = {"loss": loss.detach(), "policy_loss": loss.detach(),
                 "dpo/accuracy": (margin.detach() > 0).double().mean(), "dpo/margin": margin.detach().mean()}
        return loss, stats
