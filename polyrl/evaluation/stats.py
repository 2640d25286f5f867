"""Paired statistics of an evaluation (docs/evaluation.md, "Statistics"), as small pure functions of per-prompt scores.

A scorer's scores are a (P, K) array: P prompts, K samples each (`eval.samples_per_prompt`), sample k of prompt p
drawn from the same noise for the checkpoint and for its base. Every statistic treats the prompt as the unit (its K
samples are averaged first), so a prompt set's categories and its bootstrap resample prompts, not samples:

    prompt mean        m_p   = (1/K) Σ_k s_pk
    mean               μ     = (1/P) Σ_p m_p
    ci95               the 2.5th and 97.5th percentiles (numpy's linear interpolation) of μ over B bootstrap
                       resamples, each P prompts drawn with replacement (np.random.default_rng(seed))
    delta              Δ     = μ(checkpoint) − μ(base) = (1/P) Σ_p d_p,  d_p = m_p(checkpoint) − m_p(base)
    delta_ci95         the same percentiles of the mean of d_p over the same resamples (a paired bootstrap)
    win_rate           (wins + ties / 2) / (P·K) over the paired samples: a win when s_pk(checkpoint) > s_pk(base)
    category_mean      (1/C) Σ_c μ_c over the C categories (GenEval's overall score: the mean of its tags' scores)
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 1000


def _as_2d(scores) -> np.ndarray:
    """(P, K) float64; a (P,) array is one sample per prompt."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"scores must be (prompts, samples) with at least one of each, got shape {x.shape}")
    return x


def prompt_means(scores) -> np.ndarray:
    """m_p: each prompt's mean over its samples, (P,)."""
    return _as_2d(scores).mean(axis=1)


def mean(scores) -> float:
    """μ: the mean over prompts of the prompt means."""
    return float(prompt_means(scores).mean())


def bootstrap_indices(n: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """(B, n) prompt indices, each row n draws with replacement: the resamples every ci95 of one report shares."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_ci95(values, seed: int, resamples: int = RESAMPLES) -> list[float]:
    """[lo, hi]: the 2.5th / 97.5th percentiles of the mean of `values` (one number per prompt) over the bootstrap
    resamples of `bootstrap_indices(len(values), seed, resamples)`."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    means = v[bootstrap_indices(len(v), seed, resamples)].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return [float(lo), float(hi)]


def win_rate(scores, base) -> float:
    """(wins + ties / 2) / samples over the paired samples (a tie is half a win: a scorer that does not tell the two
    apart gives 0.5)."""
    a, b = _as_2d(scores), _as_2d(base)
    if a.shape != b.shape:
        raise ValueError(f"paired scores differ in shape: {a.shape} vs {b.shape}")
    return float(((a > b).sum() + 0.5 * (a == b).sum()) / a.size)


def summarize(scores, seed: int, resamples: int = RESAMPLES, base=None) -> dict:
    """One scorer on one set of prompts: `mean`, `ci95`, `prompts`, `samples`; with `base` (same shape, paired
    sample by sample) also `base_mean`, `base_ci95`, `delta`, `delta_ci95`, `win_rate`."""
    a = _as_2d(scores)
    out = {"mean": mean(a), "ci95": bootstrap_ci95(prompt_means(a), seed, resamples),
           "prompts": int(a.shape[0]), "samples": int(a.size)}
    if base is not None:
        b = _as_2d(base)
        if a.shape != b.shape:
            raise ValueError(f"paired scores differ in shape: {a.shape} vs {b.shape}")
        d = prompt_means(a) - prompt_means(b)
        out.update(base_mean=mean(b), base_ci95=bootstrap_ci95(prompt_means(b), seed, resamples),
                   delta=float(d.mean()), delta_ci95=bootstrap_ci95(d, seed, resamples), win_rate=win_rate(a, b))
    return out


def summarize_by_category(scores, categories: list, seed: int, resamples: int = RESAMPLES, base=None) -> dict:
    """`summarize` over all prompts, plus `categories` ({name: summarize over that category's prompts}) and
    `category_mean` (and `base_category_mean`, `category_delta` with a base) when any prompt has a category
    (`categories[p]` None: uncategorised, counted only in the overall numbers)."""
    a = _as_2d(scores)
    b = None if base is None else _as_2d(base)
    if len(categories) != a.shape[0]:
        raise ValueError(f"{len(categories)} categories for {a.shape[0]} prompts")
    out = summarize(a, seed, resamples, b)
    names = list(dict.fromkeys(c for c in categories if c is not None))
    if not names:
        return out
    out["categories"] = {}
    for name in names:
        rows = np.array([c == name for c in categories])
        out["categories"][name] = summarize(a[rows], seed, resamples, None if b is None else b[rows])
    out["category_mean"] = float(np.mean([c["mean"] for c in out["categories"].values()]))
    if b is not None:
        out["base_category_mean"] = float(np.mean([c["base_mean"] for c in out["categories"].values()]))
        out["category_delta"] = out["category_mean"] - out["base_category_mean"]
    return out
