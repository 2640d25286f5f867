"""Algorithm interface: advantages from rewards, and a differentiable loss for one loss term.

The actor backend owns the optimisation loop (mini-batches, accumulation over the loss terms, clipping, the
old/EMA copy); an algorithm only says what to minimise, through a `PolicyEvaluator` that re-runs one sampler step
(or one velocity) under a named policy, and declares what it needs. The actor and trainer serve these
declarations generically, so neither holds an algorithm special case.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..batch import Rollout
from ..draws import UpdateDraws
from ..latents import Latents
from ..registry import Registry
from ..sampling.steps import StepOut
from .advantage import group_advantages

POLICIES = ("current", "reference", "old", "teacher")  # and "teacher:<j>", the j-th of several teachers


class PolicyEvaluator(Protocol):
    draws: UpdateDraws  # the update's random numbers, keyed by sample and term (forward-process t, ε; §7)

    def step(self, batch: Rollout, k: int, policy: str = "current") -> StepOut:
        """Re-score the stored transition latents[:, k] -> latents[:, k+1] under `policy` (one of POLICIES).

        For the current policy `StepOut.weight` carries the rollout-correction weight (§4), or None.
        """
        ...

    def stream_sigmas(self, sigma: torch.Tensor) -> torch.Tensor | Latents:
        """σ of the stored grid -> each latent entry's σ (`DiffusionPolicy.stream_sigmas`): forward-process losses
        noise each entry at its own σ."""
        ...

    def velocity(self, batch: Rollout, latents: Latents, sigma: torch.Tensor, policy: str = "current",
                 guidance: float | None = None) -> Latents:
        """The network's velocity at arbitrary latents (forward-process losses); guidance None = the rollout's."""
        ...

    def sigma_grid(self) -> torch.Tensor:
        """The rollout's sampling grid σ_0 = 1 > … > σ_N = 0 (float32, N + 1 values): forward-process losses that
        train at the grid's own timesteps (DGPO, AWM: Flow-Factory's `discrete` time sampling) draw from it."""
        ...


class AlgorithmBase:
    """Defaults for the declarations the actor and trainer read; an algorithm overrides what it needs."""

    kl_beta: float = 0.0  # β of the KL to the reference that every policy-gradient loss may add (§3)
    needs_old: bool = False  # an EMA copy of the trainable weights (the `old` policy)
    samples_from_old: bool = False  # the rollout runs under the `old` policy
    uses_log_probs: bool = True  # False: likelihood-free (ODE rollouts allowed, no rollout correction)
    trains_on_pairs: bool = False  # accepts offline preference pairs (data.pairs_path)
    teacher_path: str | None = None  # a frozen teacher (polyrl checkpoint or diffusers directory)
    adv_std: str = "global"
    adv_clip_max: float = 5.0
    kl_form: str = "exact"  # the KL term's form: exact | flow_grpo (§3 convention (a), flow_grpo.kl_to_reference)
    drop_zero_advantage: bool = False  # train without the samples whose advantage is 0 (§3 convention (c))
    # step options any algorithm takes (STEP_OPTIONS): the step's filter-and-refill of flat groups (trainer/step.py)
    dynamic_sampling: bool = False
    max_refills: int = 3  # at most this many extra rollouts per step
    whole_groups: bool = False  # every mini- and micro-batch holds whole prompt groups (DGPO's group preference)
    old_every_optimizer_step: bool = False  # the old (EMA) copy moves after every optimizer step, not every update
    # the clock `old_decay` reads after an update: "update" (updates before this one) or "optimizer_step" (optimizer
    # steps taken so far, this update's included: DiffusionNFT's authors' `return_decay(global_step)`)
    old_decay_clock: str = "update"

    @property
    def needs_reference(self) -> bool:
        """A reference policy (LoRA disabled / frozen initial copy): by default, for the KL term."""
        return self.kl_beta > 0

    def num_terms(self, batch: Rollout) -> int:
        """Loss terms per sample; the actor averages `step_loss` over k in range(num_terms)."""
        return batch.log_probs.shape[1]

    def num_terms_on(self, batch: Rollout, policy: PolicyEvaluator) -> int:
        """`num_terms` where it depends on the policy's sampling grid (DiffusionNFT's grid draw: int(fraction·N));
        the actor calls this one. Default: `num_terms(batch)`."""
        return self.num_terms(batch)

    def prepare(self, batch: Rollout) -> Rollout:
        """The training batch made from a scored rollout (e.g. DPO pairs); default: the rollout itself, without
        its zero-advantage samples when `drop_zero_advantage` (flow_grpo's choice: a flat group then does not
        dilute the mean of the policy gradient)."""
        if not self.drop_zero_advantage:
            return batch
        return batch.select(torch.nonzero(batch.advantages != 0).flatten())

    def shape_rewards(self, batch: Rollout) -> torch.Tensor:
        """The rewards the advantages are computed from (DAPO adds its overlong penalty); default: as scored."""
        return batch.rewards

    def old_decay(self, update: int) -> float | None:
        """Decay d of the old-policy update old ← d·old + (1−d)·θ after update number `update` (optimizer step
        number with `old_every_optimizer_step`; the optimizer steps taken so far with `old_decay_clock` =
        "optimizer_step"); None: actor.ema_decay."""
        return None

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


Algorithm = AlgorithmBase


def sample_index(batch: Rollout) -> torch.Tensor:
    """(B,) the samples' places in the step's global batch (the keys of their draws, §7); a batch outside an update
    (a test's, an evaluation's) is keyed by its own order."""
    return torch.arange(len(batch)) if batch.sample_index is None else batch.sample_index.cpu()


def latent_shapes(latents: Latents) -> dict[str, tuple[int, ...]]:
    """Each entry's per-sample shape (what one sample's noise draw fills)."""
    return {k: tuple(v.shape[1:]) for k, v in latents.items()}


def weighted_mean(per_sample: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """mean_b(w·ℓ): rejected sample-steps (w = 0) count in the denominator, so masking never rescales the loss."""
    return per_sample.mean() if weight is None else (per_sample * weight.to(per_sample)).mean()


def compute_advantages(algo: Algorithm, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Advantages of a whole step's rewards (every rank's: group and global statistics span the global batch)."""
    return group_advantages(rewards, group_ids, algo.adv_std, algo.adv_clip_max)


ALGORITHMS = Registry("algorithm")
register_algorithm = ALGORITHMS.register


# keys of `algorithm.*` that every algorithm accepts: they configure the step, not the loss
STEP_OPTIONS = ("dynamic_sampling", "max_refills")


def build_algorithm(cfg: dict) -> Algorithm:
    cfg = dict(cfg)
    options = {k: cfg.pop(k) for k in STEP_OPTIONS if k in cfg}
    algo = ALGORITHMS.build(cfg.pop("name"), **cfg)
    if not isinstance(options.get("dynamic_sampling", False), bool):
        raise ValueError(f"algorithm.dynamic_sampling={options['dynamic_sampling']!r} must be true or false")
    refills = options.get("max_refills", 0)
    if isinstance(refills, bool) or not isinstance(refills, int) or refills < 0:
        raise ValueError(f"algorithm.max_refills={refills!r} must be an integer >= 0")
    for key, value in options.items():
        setattr(algo, key, value)
    return algo
