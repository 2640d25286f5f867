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

Per-component normalisation (`normalize`, on the mix for every component or on one component; docs/rewards.md
"Several rewards at once"): the s_ci above are first mapped to z_ci, then mixed as above.

* `none` (default): z = s.
* `running`: z = (s − μ_c) / σ_c with μ_c, σ_c the mean and (population) standard deviation of every score the
  component gave in the run's earlier training steps (`running_stats`, Chan et al.'s pairwise update); a step's own
  scores join them when the step has trained (`end_step`), so every sample of a step, whatever the chunking
  (`reward.async`), is normalised by the same numbers, and evaluations never enter them. With no earlier step (the
  first step, or outside training) the call's own scores give μ, σ. A component whose scores have not varied
  (σ < 1e-8) gives z = s − μ. The statistics are saved in checkpoints (`reward_state`).
* `rank`: z = the score's rank within its prompt group, 0 (lowest) .. 1 (highest), r / (m − 1) with ties given their
  mean rank, m the group's members the component scored (0.5 when m = 1). A mix with a `rank` component is a group
  reward.

Each component's term of r_i, t_ci = w_c z_ci (Σ_c |w_c|) / (Σ_{c∈S_i} |w_c|) (0 where it failed, so Σ_c t_ci = r_i),
is the extra `reward/<label>/term`; the trainer splits the step's advantage into these terms
(algorithms/advantage.py `advantage_parts`) and logs each one's part.

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
COMPONENT_KEYS = ("weight", "required", "reward", "normalize")
NORMALIZE = ("none", "running", "rank")
TERM = "/term"  # reward/<label>/term: a component's term of the mixed reward
FRAME_KEYS = ("frames", "frame_reduce")  # a component's frame sampling (build_reward's options)


@dataclass
class Component:
    label: str
    reward: str  # registered name
    weight: float
    required: bool = True
    kwargs: dict = field(default_factory=dict)
    frame_options: dict = field(default_factory=dict)  # frames / frame_reduce, when set
    normalize: str = "none"


def parse_mix(mix, normalize: str = "none") -> list[Component]:
    """The components of a `reward.mix` mapping (`normalize`: the mix's default for them); ValueError naming the key
    for anything malformed."""
    if normalize not in NORMALIZE:
        raise ValueError(f"reward.normalize={normalize!r} is not valid; allowed: {', '.join(NORMALIZE)}")
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
        norm = spec.pop("normalize", normalize)
        if norm not in NORMALIZE:
            raise ValueError(f"{key}.normalize={norm!r} is not valid; allowed: {', '.join(NORMALIZE)}")
        name = spec.pop("reward", label)
        if name not in REWARDS:
            hint = "" if "reward" in (mix[label] if isinstance(mix[label], dict) else {}) else \
                f" (the label is the reward's name unless {key}.reward is set)"
            raise ValueError(f"{key}: reward {name!r} is not registered{hint}; allowed: {', '.join(sorted(REWARDS))}")
        frame_options = {k: spec.pop(k) for k in FRAME_KEYS if k in spec}
        pop_frame_sampling({"name": name, **frame_options}, key)  # checks the values, names the key
        out.append(Component(str(label), name, float(weight), required, spec, frame_options, norm))
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

    def __init__(self, mix: dict, normalize: str = "none"):
        self.components = parse_mix(mix, normalize)
        self.rewards = {c.label: build_reward({"name": c.reward, **c.kwargs, **c.frame_options},
                                              f"reward.mix.{c.label}") for c in self.components}
        self.inputs = tuple(sorted(set().union(*(reward_inputs(r) for r in self.rewards.values()))))
        media = set().union(*(reward_media(r) for r in self.rewards.values()))
        self.media = tuple(k for k in MEDIA_KINDS if k in media or (k == "video" and "images" in media))
        self.ranked = any(c.normalize == "rank" for c in self.components)
        self.groupwise = self.ranked or any(is_groupwise(r) for r in self.rewards.values())
        self.last_errors: dict[str, str] = {}
        # normalize=running: the statistics of earlier training steps, and this step's scores until it has trained
        self.running_stats: dict[str, tuple[float, float, float]] = {}  # label -> (count, mean, M2)
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._recording = False

    def preflight(self) -> None:
        """Each component's own check before training (reward=http: its server answers), then whether the mix is a
        group reward again (an http component learns that from its server here)."""
        for reward in self.rewards.values():
            if hasattr(reward, "preflight"):
                reward.preflight()
        self.groupwise = self.ranked or any(is_groupwise(r) for r in self.rewards.values())

    def begin_step(self, train: bool = True) -> None:
        """A new step (`train`) or evaluation (not `train`: its scores never join the running statistics), told to each
        component that wants to know (a remote judge's retry budget)."""
        self._recording = bool(train)
        for reward in self.rewards.values():
            if hasattr(reward, "begin_step"):
                reward.begin_step(train=train)

    def end_step(self) -> None:
        """The step has trained: its scores join the running statistics."""
        for label, parts in self._pending.items():
            values = torch.cat(parts)
            self.running_stats[label] = merge_stats(self.running_stats.get(label), values)
        self._pending = {}

    def reward_state(self) -> dict:
        """The running statistics of the steps that trained (what a checkpoint keeps)."""
        return {"running_stats": {k: list(v) for k, v in self.running_stats.items()}}

    def load_reward_state(self, state: dict) -> None:
        self.running_stats = {k: tuple(float(x) for x in v) for k, v in (state.get("running_stats") or {}).items()}
        self._pending = {}

    def close(self) -> None:
        for reward in self.rewards.values():
            if hasattr(reward, "close"):
                reward.close()

    @staticmethod
    def nested_configs(cfg: dict) -> list[tuple[str, dict]]:
        """(config key, {"name": ..., kwargs}) per component, for `polyrl.config.schema` to validate."""
        return [(f"reward.mix.{c.label}", {"name": c.reward, **c.kwargs})
                for c in parse_mix(cfg.get("mix"), cfg.get("normalize", "none"))]

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
        groups = None
        if self.ranked:
            from .base import checked_group_ids

            groups = checked_group_ids(self, group_ids, n)
        for comp in self.components:
            scores, comp_extras, error = self._score_one(comp, media, prompts, metadata, latents, n, group_ids)
            if error is not None:
                self.last_errors[comp.label] = error
                log.warning("reward.mix: optional component %r failed (excluded from the sum): %s", comp.label, error)
            z = self._normalize(comp, scores, groups)
            columns.append(z)
            weights.append(comp.weight)
            extras[f"reward/{comp.label}"] = scores.tolist()
            extras[f"reward/{comp.label}/failed"] = torch.isnan(scores).double().tolist()
            if comp.normalize != "none":
                extras[f"reward/{comp.label}/normalized"] = z.tolist()
            for k, v in comp_extras.items():
                extras[k if k not in extras else f"{comp.label}/{k}"] = v
        z = torch.stack(columns, 1)
        w = torch.tensor(weights, dtype=torch.float64)
        total = mix_scores(z, w)
        unscored = torch.isnan(total)
        if unscored.any():
            first = int(unscored.nonzero()[0])
            raise RuntimeError(f"reward.mix: no component scored {int(unscored.sum())} of {n} samples "
                               f"(first: sample {first}); errors: {self.last_errors}")
        for comp, t in zip(self.components, mix_terms(z, w).unbind(1), strict=True):
            extras[f"reward/{comp.label}{TERM}"] = t.tolist()
        return RewardOutput(total.float(), extras)

    def _normalize(self, comp: Component, scores: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        """z of the module docstring for one component's (n,) float64 scores (NaN where it failed stays NaN)."""
        if comp.normalize == "none":
            return scores
        if comp.normalize == "rank":
            return group_ranks(scores, groups)
        ok = ~torch.isnan(scores)
        if self._recording and ok.any():
            self._pending.setdefault(comp.label, []).append(scores[ok].clone())
        stats = self.running_stats.get(comp.label)
        if stats is None or stats[0] < 1:  # no earlier step: this call's own scores
            stats = merge_stats(None, scores[ok]) if ok.any() else (0.0, 0.0, 0.0)
        return standardize(scores, stats)


def merge_stats(stats: tuple[float, float, float] | None, values: torch.Tensor) -> tuple[float, float, float]:
    """(count, mean, M2) of `stats`' values and `values` together (Chan, Golub & LeVeque's pairwise update:
    M2 = M2_a + M2_b + δ² n_a n_b / n, δ = mean_b − mean_a), in float64."""
    v = values.detach().to(torch.float64).reshape(-1)
    nb = float(v.numel())
    if nb == 0:
        return stats or (0.0, 0.0, 0.0)
    mb = float(v.mean())
    m2b = float(((v - mb) ** 2).sum())
    if not stats or stats[0] == 0:
        return nb, mb, m2b
    na, ma, m2a = stats
    n = na + nb
    delta = mb - ma
    return n, ma + delta * nb / n, m2a + m2b + delta * delta * na * nb / n


def standardize(scores: torch.Tensor, stats: tuple[float, float, float]) -> torch.Tensor:
    """(s − μ) / σ with μ, σ² = mean, M2 / count of `stats` (population); s − μ when σ < 1e-8."""
    count, mean, m2 = stats
    std = math.sqrt(m2 / count) if count > 0 else 0.0
    centred = scores - mean
    return centred / std if std >= 1e-8 else centred


def group_ranks(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each score's rank within its group in [0, 1]: r / (m − 1), r the 0-based ascending rank (ties: their mean
    rank) among the group's m finite scores; 0.5 when m = 1; NaN stays NaN."""
    out = torch.full_like(scores, math.nan)
    for g in torch.unique(group_ids):
        idx = torch.nonzero((group_ids == g) & ~torch.isnan(scores)).flatten()
        m = len(idx)
        if m == 1:
            out[idx] = 0.5
            continue
        vals = scores[idx]
        below = (vals[None, :] < vals[:, None]).sum(1).double()  # how many are lower
        equal = (vals[None, :] == vals[:, None]).sum(1).double()  # itself included
        out[idx] = (below + (equal - 1) / 2) / (m - 1)
    return out


def mix_terms(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, K) terms t_ck = w_c z_ck (Σ_c |w_c|) / (Σ_{c scored} |w_c|), 0 where a component failed: each row sums to
    `mix_scores`' value."""
    ok = ~torch.isnan(scores)
    w = weights.to(scores.dtype).expand_as(scores)
    ok_weight = torch.where(ok, w.abs(), torch.zeros_like(w)).sum(1, keepdim=True)
    scale = weights.abs().sum() / ok_weight.clamp_min(1e-300)
    return torch.where(ok, scores * w * scale, torch.zeros_like(scores))


def reward_terms(extras: dict, n: int) -> tuple[list[str], torch.Tensor] | None:
    """(labels, (n, K) float64) of a mix's `reward/<label>/term` extras, in their order; None when there are none."""
    keys = [k for k in extras if k.startswith("reward/") and k.endswith(TERM)]
    if not keys:
        return None
    cols = []
    for k in keys:
        v = [0.0 if x is None else float(x) for x in extras[k]]
        if len(v) != n:
            return None
        cols.append(torch.tensor(v, dtype=torch.float64))
    return [k[len("reward/"): -len(TERM)] for k in keys], torch.nan_to_num(torch.stack(cols, 1))


def mix_scores(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Renormalised weighted sum of the module docstring. `scores` (B, K) with NaN for a failed component,
    `weights` (K,). A row with no finite score gives NaN."""
    ok = ~torch.isnan(scores)
    w = weights.to(scores.dtype).expand_as(scores)
    weighted = torch.where(ok, scores * w, torch.zeros_like(scores)).sum(1)
    ok_weight = torch.where(ok, w.abs(), torch.zeros_like(w)).sum(1)
    scale = weights.abs().sum() / ok_weight
    return torch.where(ok.any(1), weighted * scale, torch.full_like(weighted, math.nan))
