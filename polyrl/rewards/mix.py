"""`mix`: a weighted sum of registered rewards, each component logged, failures never a silent 0.

Config (docs/rewards.md, "Multi-reward"):

    reward=mix reward.mix={ocr: 0.7, pickscore: 0.3}

or in YAML, a component as a weight, or as a mapping with `weight`, optional `required` (default true),
optional `reward` (the registered name when the label is not one, so one scorer can appear twice) and the
component's own constructor arguments:

    name: mix
    mix:
      ocr: 0.7
      pickscore: {weight: 0.3, required: false, path: /ckpt/pickscore}
    clip_score: {weight: 0.2, frames: 4, frame_reduce: min}   # an image scorer on video: its own frames

A component's `frames` / `frame_reduce` are its own (how that image scorer reads video, rewards/base.py); the
mix itself passes the media to every component as it is, so it takes none.

Per sample i, with S_i the components that scored it (no exception, finite score):

    r_i = (sum_{c in S_i} w_c s_ci) * (sum_c |w_c|) / (sum_{c in S_i} |w_c|)

i.e. the plain weighted sum when every component scored, and the same total weight spread over the
components that did otherwise (renormalised, so an optional component's failure does not shift the reward's
scale). A `required` component that raises or returns a non-finite score stops the step with an error naming
it; a sample that no component scored stops the step too.

A mix with a group reward among its components (`reward=group_diversity`, `vlm_judge` with `mode: groupwise`) is a
group reward itself (`groupwise`): the stage gives it whole groups and their ids, which it passes to each group
component; the per-sample components score the same samples as they always do.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from .base import (
    MEDIA_KINDS,
    REWARDS,
    RewardOutput,
    build_reward,
    call_reward,
    is_groupwise,
    media_len,
    pop_frame_sampling,
    register_reward,
    reward_inputs,
    reward_media,
)
from .stage import RewardUnavailable

log = logging.getLogger(__name__)
RESERVED_LABELS = ("mean", "std")  # reward/mean and reward/std are the trainer's own metrics
COMPONENT_KEYS = ("weight", "required", "reward")
FRAME_KEYS = ("frames", "frame_reduce")  # a component's frame sampling (build_reward's options)


@dataclass
class Component:
    label: str
    reward: str  # registered name
    weight: float
    required: bool = True
    kwargs: dict = field(default_factory=dict)
    frame_options: dict = field(default_factory=dict)  # frames / frame_reduce, when set


def parse_mix(mix) -> list[Component]:
    """The components of a `reward.mix` mapping; ValueError naming the key for anything malformed."""
    if not isinstance(mix, dict) or not mix:
        raise ValueError("reward.mix must be a non-empty mapping of component -> weight, e.g. "
                         "reward.mix={ocr: 0.7, pickscore: 0.3}")
    out = []
    for label, spec in mix.items():
        key = f"reward.mix.{label}"
        if label in RESERVED_LABELS or "/" in str(label):
            raise ValueError(f"{key}: the label may not be {' or '.join(RESERVED_LABELS)} or contain '/'")
        spec = {"weight": spec} if not isinstance(spec, dict) else dict(spec)
        if "weight" not in spec:
            raise ValueError(f"{key}.weight must be set")
        weight = spec.pop("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"{key}.weight={weight!r} must be a finite number")
        required = spec.pop("required", True)
        if not isinstance(required, bool):
            raise ValueError(f"{key}.required={required!r} must be true or false")
        name = spec.pop("reward", label)
        if name not in REWARDS:
            hint = "" if "reward" in (mix[label] if isinstance(mix[label], dict) else {}) else \
                f" (the label is the reward's name unless {key}.reward is set)"
            raise ValueError(f"{key}: reward {name!r} is not registered{hint}; allowed: {', '.join(sorted(REWARDS))}")
        frame_options = {k: spec.pop(k) for k in FRAME_KEYS if k in spec}
        pop_frame_sampling({"name": name, **frame_options}, key)  # checks the values, names the key
        out.append(Component(str(label), name, float(weight), required, spec, frame_options))
    if sum(abs(c.weight) for c in out) == 0:
        raise ValueError("reward.mix: all weights are 0")
    return out


@register_reward("mix")
class MixReward:
    """Weighted sum of rewards (see the module docstring). Extras per component: `reward/<label>` (its
    score, NaN where it failed), `reward/<label>/failed` (1.0 where it failed, so the logged mean is the
    fraction of the step's samples it failed on), plus each component's own extras.

    Media go to every component as they are (`call_reward` applies each one's own frame sampling to video), so
    the class reads every kind; an instance reads what its components read (video too when one reads images)."""

    media = MEDIA_KINDS

    def __init__(self, mix: dict):
        self.components = parse_mix(mix)
        self.rewards = {c.label: build_reward({"name": c.reward, **c.kwargs, **c.frame_options},
                                              f"reward.mix.{c.label}") for c in self.components}
        self.inputs = tuple(sorted(set().union(*(reward_inputs(r) for r in self.rewards.values()))))
        media = set().union(*(reward_media(r) for r in self.rewards.values()))
        self.media = tuple(k for k in MEDIA_KINDS if k in media or (k == "video" and "images" in media))
        self.groupwise = any(is_groupwise(r) for r in self.rewards.values())
        self.last_errors: dict[str, str] = {}

    def preflight(self) -> None:
        """Each component's own check before training (reward=http: its server answers), then whether the mix is a
        group reward again (an http component learns that from its server here)."""
        for reward in self.rewards.values():
            if hasattr(reward, "preflight"):
                reward.preflight()
        self.groupwise = any(is_groupwise(r) for r in self.rewards.values())

    def begin_step(self) -> None:
        """A new step, told to each component that wants to know (a remote judge's retry budget)."""
        for reward in self.rewards.values():
            if hasattr(reward, "begin_step"):
                reward.begin_step()

    def close(self) -> None:
        for reward in self.rewards.values():
            if hasattr(reward, "close"):
                reward.close()

    @staticmethod
    def nested_configs(cfg: dict) -> list[tuple[str, dict]]:
        """(config key, {"name": ..., kwargs}) per component, for `polyrl.config.schema` to validate."""
        return [(f"reward.mix.{c.label}", {"name": c.reward, **c.kwargs}) for c in parse_mix(cfg.get("mix"))]

    def _score_one(self, comp: Component, media, prompts, metadata, latents, n: int, group_ids=None):
        """(scores (n,) float64 with NaN where it failed, extras, error text or None)."""
        try:
            out = call_reward(self.rewards[comp.label], media, prompts, metadata, latents, group_ids=group_ids)
            scores = torch.as_tensor(out.scores).detach().to("cpu", torch.float64).reshape(-1)
            if scores.numel() != n:
                raise ValueError(f"returned {scores.numel()} scores for {n} samples")
        except Exception as e:  # noqa: BLE001  (any failure of a component is reported, never hidden)
            if comp.required:  # a service that gave up stays one (the trainer saves the last step and stops)
                kind = RewardUnavailable if isinstance(e, RewardUnavailable) else RuntimeError
                raise kind(f"reward.mix component {comp.label!r} (required) failed: {type(e).__name__}: {e}") from e
            return torch.full((n,), math.nan, dtype=torch.float64), {}, f"{type(e).__name__}: {e}"
        bad = ~torch.isfinite(scores)
        if bad.any() and comp.required:
            raise RuntimeError(f"reward.mix component {comp.label!r} (required) returned {int(bad.sum())} "
                               f"non-finite scores of {n}")
        scores = torch.where(bad, torch.full_like(scores, math.nan), scores)
        return scores, out.extras, (f"{int(bad.sum())} non-finite scores" if bad.any() else None)

    def __call__(self, media, prompts, metadata, latents: torch.Tensor | None = None,
                 group_ids: torch.Tensor | None = None) -> RewardOutput:
        n = media_len(media) if media is not None else int(latents.shape[0])
        if len(prompts) != n:
            raise ValueError(f"reward mix: got {n} samples but {len(prompts)} prompts")
        extras: dict = {}
        columns, weights = [], []
        self.last_errors = {}
        for comp in self.components:
            scores, comp_extras, error = self._score_one(comp, media, prompts, metadata, latents, n, group_ids)
            if error is not None:
                self.last_errors[comp.label] = error
                log.warning("reward.mix: optional component %r failed (excluded from the sum): %s", comp.label, error)
            columns.append(scores)
            weights.append(comp.weight)
            extras[f"reward/{comp.label}"] = scores.tolist()
            extras[f"reward/{comp.label}/failed"] = torch.isnan(scores).double().tolist()
            for k, v in comp_extras.items():
                extras[k if k not in extras else f"{comp.label}/{k}"] = v
        total = mix_scores(torch.stack(columns, 1), torch.tensor(weights, dtype=torch.float64))
        unscored = torch.isnan(total)
        if unscored.any():
            first = int(unscored.nonzero()[0])
            raise RuntimeError(f"reward.mix: no component scored {int(unscored.sum())} of {n} samples "
                               f"(first: sample {first}); errors: {self.last_errors}")
        return RewardOutput(total.float(), extras)


def mix_scores(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Renormalised weighted sum of the module docstring. `scores` (B, K) with NaN for a failed component,
    `weights` (K,). A row with no finite score gives NaN."""
    ok = ~torch.isnan(scores)
    w = weights.to(scores.dtype).expand_as(scores)
    weighted = torch.where(ok, scores * w, torch.zeros_like(scores)).sum(1)
    ok_weight = torch.where(ok, w.abs(), torch.zeros_like(w)).sum(1)
    scale = weights.abs().sum() / ok_weight
    return torch.where(ok.any(1), weighted * scale, torch.full_like(weighted, math.nan))
