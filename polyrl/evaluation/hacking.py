"""The reward-hacking watch (docs/evaluation.md, "Reward hacking watch"): a pure function of the evaluation history.

Each evaluation scores the same held-out prompts from the same noise with the training reward and with other
scorers; for each it has the mean μ and the bootstrap ci95 [lo, hi] over prompts (stats.summarize). Between the
first evaluation (0) and the latest (t), with h = (hi − lo) / 2 the ci95 half-width:

    noise_s       = sqrt(h_s(0)² + h_s(t)²)                 (the two evaluations' bootstrap noise, combined)
    reward rose   : μ_r(t) − μ_r(0) > 0
    scorer fell   : μ_s(0) − μ_s(t) > noise_s

The alarm is on when the reward rose and at least one other scorer fell: the training signal improves while
something it does not measure gets worse (the classic failure of PickScore- or OCR-only training). Using the ci95
half-widths as noise makes a fall on pure sampling noise rare (about 2.5% per scorer for independent evaluations,
fewer for evaluations on the same prompts and noise, whose means move together).
"""

from __future__ import annotations

import math


def half_width(ci95) -> float:
    lo, hi = (float(v) for v in ci95)
    if not hi >= lo:
        raise ValueError(f"ci95 {list(ci95)} must be [lo, hi] with lo <= hi")
    return (hi - lo) / 2


def history_entry(step: int, scores: dict[str, list[float]], prompt_keys: list[str], seed: int,
                  resamples: int = 1000) -> dict:
    """One evaluation of the history from its per-sample scores ({scorer: one score per sample}) and each sample's
    prompt (`prompt_keys`; a prompt may have several samples, not necessarily as many as the others): per scorer the
    mean of the prompt means and its bootstrap ci95 over prompts (stats.bootstrap_ci95)."""
    from .stats import bootstrap_ci95

    order = list(dict.fromkeys(prompt_keys))
    entry = {"step": step, "means": {}, "ci95": {}}
    for name, values in scores.items():
        if len(values) != len(prompt_keys):
            raise ValueError(f"{len(values)} {name} scores for {len(prompt_keys)} samples")
        sums = {k: [0.0, 0] for k in order}
        for k, v in zip(prompt_keys, values, strict=True):
            sums[k][0] += float(v)
            sums[k][1] += 1
        means = [s / n for s, n in sums.values()]
        entry["means"][name] = sum(means) / len(means)
        entry["ci95"][name] = bootstrap_ci95(means, seed, resamples)
    return entry


def hacking_alarm(history: list[dict], reward: str) -> list[dict]:
    """The scorers that fell while `reward` rose, between `history[0]` and `history[-1]` (module docstring).

    Each evaluation is `{"step": int, "means": {name: μ}, "ci95": {name: [lo, hi]}}` and holds `reward`; a scorer
    missing from either evaluation is not judged. Returns one `{"scorer", "step", "first", "now", "drop", "noise",
    "reward_first", "reward_now"}` per fallen scorer (empty: no alarm)."""
    if len(history) < 2:
        return []
    first, now = history[0], history[-1]
    for e in (first, now):
        if reward not in e["means"]:
            raise ValueError(f"evaluation at step {e.get('step')} has no mean for the training reward {reward!r}")
    if not now["means"][reward] > first["means"][reward]:
        return []
    fallen = []
    for name, was in first["means"].items():
        if name == reward or name not in now["means"] or name not in first["ci95"] or name not in now["ci95"]:
            continue
        noise = math.hypot(half_width(first["ci95"][name]), half_width(now["ci95"][name]))
        drop = float(was) - float(now["means"][name])
        if drop > noise:
            fallen.append({"scorer": name, "step": now.get("step"), "first": float(was),
                           "now": float(now["means"][name]), "drop": drop, "noise": noise,
                           "reward_first": float(first["means"][reward]), "reward_now": float(now["means"][reward])})
    return fallen


def alarm_line(fallen: list[dict], reward: str) -> str:
    """The one warning line the trainer prints."""
    parts = [f"{f['scorer']} {f['first']:.4f} -> {f['now']:.4f} (fell {f['drop']:.4f} > noise {f['noise']:.4f})"
             for f in fallen]
    f = fallen[0]
    return (f"polyrl: warning: possible reward hacking at step {f['step']}: held-out {reward} rose "
            f"{f['reward_first']:.4f} -> {f['reward_now']:.4f} while " + "; ".join(parts))
