"""`polyrl eval`'s grids: the samples of the largest gains and losses of the first scorer (or, without a base, the
best and worst), sampled again from their seeds, each checkpoint tile beside its base tile."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from .plan import EvalOptions, Models, sample_chunk


def pick_extremes(records: list[dict], scorer: str, k: int, paired: bool) -> tuple[list, list]:
    """The k (prompt index, sample) of the largest gains and of the largest losses of `scorer` (samples that neither
    gained nor lost are in neither; without a base: the highest and the lowest scores), best-first / worst-first."""
    items = []
    for r in records:
        for s, v in enumerate(r["scores"][scorer]):
            items.append((v - r["base"][scorer][s] if paired else v, r["index"], s))
    items.sort(key=lambda t: (t[0], t[1], t[2]))
    top = [(i, s) for v, i, s in reversed(items[-k:]) if v > 0 or not paired] if k else []
    low = [(i, s) for v, i, s in items[:k] if v < 0 or not paired]
    return top, low

def write_grids(out: Path, models: Models, plan, rows, records, scorers, opts: EvalOptions) -> list[Path]:
    """Grids of the largest gains and losses of the first scorer, re-sampled from their seeds (the same samples the
    report scored); paired: each checkpoint tile beside its base tile. Each tile's caption: its prompt, the first
    scorer's score and the other scorers' (`pickscore=0.21`)."""
    from ..models.base import prompt_text
    from ..trainer.samples import save_samples

    name = next(iter(scorers))
    top, low = pick_extremes(records, name, opts.grid, opts.compare_base)
    by_index = {r["index"]: r for r in records}
    written = []
    for stem, keys in ((("gains", top), ("losses", low)) if opts.compare_base else (("best", top), ("worst", low))):
        if not keys:
            continue
        media, _, prompts, _, _ = sample_chunk(models, "trained", plan, rows, keys, opts.seed)
        captions = [f"{prompt_text(p)}" for p in prompts]
        scores = [by_index[i]["scores"][name][s] for i, s in keys]
        notes = [_other_scores(by_index[i]["scores"], name, s) for i, s in keys]
        if opts.compare_base:  # base, checkpoint, base, checkpoint, ...
            base_media = sample_chunk(models, "base", plan, rows, keys, opts.seed)[0]
            order = torch.arange(2 * len(keys)).view(2, -1).t().reshape(-1)
            media = {k: _interleave(base_media[k], media[k], order) for k in media}
            captions = [c for cap in captions for c in (f"base: {cap}", f"trained: {cap}")]
            scores = [v for (i, s), t in zip(keys, scores, strict=True) for v in (by_index[i]["base"][name][s], t)]
            notes = [v for (i, s), t in zip(keys, notes, strict=True)
                     for v in (_other_scores(by_index[i]["base"], name, s), t)]
        batch = SimpleNamespace(prompts=captions, rewards=torch.tensor(scores), media=media,
                                reward_extras={"caption": notes})
        written += save_samples(batch, out / stem, plan.shape.fps)
    return written

def _other_scores(scores: dict, first: str, sample: int) -> str:
    """A tile's caption line: sample `sample`'s score by every scorer but the first (the grid's `r=`)."""
    return " ".join(f"{n}={v[sample]:.2f}" for n, v in scores.items() if n != first)

def _interleave(a, b, order):
    from ..media import Audio

    if isinstance(a, Audio):
        return Audio(torch.cat([a.waveform, b.waveform])[order], a.sample_rate)
    return torch.cat([a, b])[order]
