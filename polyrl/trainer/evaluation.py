"""The held-out evaluation of a run: the rollout and reward stages without the actor.

Every evaluation samples the same held-out rows from the same seeds, deterministically (the sampler's `evaluate`:
ODE sampling for a diffusion policy, greedy decoding for a token policy), so two evaluations differ only by the
weights. Its samples are written under `<run>/samples/`: every sample as a JSON line, and a grid of
`trainer.num_validation` tiles chosen once per run to span hard to easy prompts (`pick_tiles`), each captioned with
its reward then and now.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..batch import Rollout
from ..data.prompts import split_row
from ..rewards.stage import score_batch
from .disk import DiskFull, is_disk_full
from .logging import pick_tiles
from .samples import has_media_files, save_samples, save_text_samples


def heldout_rows(rows: list[dict], n: int) -> tuple[list, list[dict]]:
    """(prompts, metadata) of n samples: the rows in order, from the start again when n exceeds them."""
    picked = [rows[i % len(rows)] for i in range(n)]
    prompts, metadata = zip(*(split_row(r) for r in picked), strict=True)
    return list(prompts), list(metadata)


def evaluate(sampler, reward, reward_name: str, rows: list[dict], n: int, seed: int) -> tuple[float, Rollout]:
    """(mean held-out reward, the scored batch) of n deterministic samples of `rows`."""
    prompts, metadata = heldout_rows(rows, n)
    batch = sampler.evaluate(prompts, metadata, seed)
    if hasattr(reward, "begin_step"):  # an evaluation, not a training step (a remote judge's budget, reward=mix's stats)
        reward.begin_step(train=False)
    score_batch(reward, reward_name, batch)
    return float(batch.rewards.mean()), batch


class SampleFiles:
    """Writes each evaluation's samples: `samples/step_N.jsonl` (every sample) and, for media, the grid
    `samples/step_N.{png,mp4,wav}` of the tiles kept in `samples/grid.json` (chosen at the first evaluation, also
    kept over a resume). They are part of the evaluation's step: each file is written under a temporary name and
    renamed (a stop in the middle leaves no torn file), and a full disk raises DiskFull (the run stops; the resumed
    run writes them again)."""

    def __init__(self, run_dir: Path, num_tiles: int, fps: float):
        self.dir, self.num_tiles, self.fps = run_dir / "samples", num_tiles, fps
        self.tiles: dict | None = None

    def write(self, batch: Rollout, step: int) -> None:
        stem = self.dir / f"step_{step:06d}"
        tmp = stem.with_name(f".{stem.name}.tmp")
        try:
            written = [save_text_samples(batch, tmp.with_suffix(".jsonl"))]
            if self.num_tiles > 0 and has_media_files(batch):
                tiles, baselines = self._grid_tiles(batch, step)
                written += save_samples(batch.select(torch.tensor(tiles)), tmp, self.fps, baselines)
            for path in dict.fromkeys(written):
                path.replace(stem.with_suffix(path.suffix))
        except Exception as e:
            for path in self.dir.glob(f".{stem.name}.*"):
                path.unlink(missing_ok=True)
            if is_disk_full(e):
                raise DiskFull(self.dir, None, None, f"samples of step {step} under") from e
            raise

    def _grid_tiles(self, batch: Rollout, step: int) -> tuple[list[int], list[float] | None]:
        """The grid's samples and their rewards at the first evaluation (None at that evaluation itself)."""
        path = self.dir / "grid.json"
        k = min(self.num_tiles, len(batch))
        if self.tiles is None and path.is_file():
            try:
                self.tiles = json.loads(path.read_text())
            except ValueError:
                self.tiles = None
        tiles = (self.tiles or {}).get("tiles", [])
        if len(tiles) != k or any(not 0 <= i < len(batch) for i in tiles):
            keys = [p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str) for p in batch.prompts]
            tiles = pick_tiles(keys, batch.rewards, k)
            self.tiles = {"step": step, "tiles": tiles, "rewards": [float(batch.rewards[i]) for i in tiles]}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".json.tmp").write_text(json.dumps(self.tiles))
            path.with_suffix(".json.tmp").replace(path)
        return tiles, (self.tiles["rewards"] if self.tiles["step"] != step else None)


class HackingWatch:
    """`trainer.eval_scorers`: every held-out evaluation is also scored by these scorers, and the reward-hacking
    watch (evaluation/hacking.py) compares the latest evaluation with the run's first. Metrics per evaluation:
    `eval/<name>` (the mean over held-out prompts of their samples' mean) with `eval/<name>/ci95_lo` and `_hi` (the
    bootstrap over prompts, seeded by `trainer.eval_seed`) for the reward and each scorer, and `eval/hacking_alarm`
    (1.0 while the reward rose and a scorer fell by more than its noise since the first evaluation). The first
    evaluation is read back from the metrics log on resume; the warning line is printed once per run."""

    def __init__(self, cfg, history: list[dict]):
        from omegaconf import OmegaConf

        from ..config.schema import scorer_configs
        from ..rewards import build_reward

        t = cfg.trainer
        self.reward_name, self.seed = cfg.reward.name, t.eval_seed
        confs = scorer_configs(list(t.eval_scorers), cfg, OmegaConf.to_container(t.eval_scorer_args),
                               "trainer.eval_scorers", "trainer.eval_scorer_args")
        self.names = [n for n in confs if n != self.reward_name]
        self.scorers = {n: build_reward(confs[n], key=f"trainer.eval_scorer_args.{n}") for n in self.names}
        self.first = self._entry_from_log(history)
        self.warned = False

    def _entry_from_log(self, history: list[dict]) -> dict | None:
        names = [self.reward_name, *self.names]
        for m in history:
            if all(f"eval/{n}/ci95_lo" in m for n in names):
                return {"step": m["step"], "means": {n: m[f"eval/{n}"] for n in names},
                        "ci95": {n: [m[f"eval/{n}/ci95_lo"], m[f"eval/{n}/ci95_hi"]] for n in names}}
        return None

    def observe(self, batch: Rollout, step: int) -> tuple[dict, str | None]:
        """(metrics of this evaluation, the warning line when the alarm fires for the first time). Each scorer's
        per-sample value (and its own caption extras) joins the batch's caption extras as `<name>/caption`
        (`<name>=0.42`), so the grid written after this shows it under every tile."""
        from ..evaluation.hacking import alarm_line, hacking_alarm, history_entry
        from ..media import primary
        from ..models.base import prompt_text
        from ..rewards.base import call_reward, caption_texts
        from ..rewards.stage import checked_scores, reward_latents

        scores = {self.reward_name: batch.rewards.tolist()}
        with torch.no_grad():
            for name, scorer in self.scorers.items():
                out = call_reward(scorer, primary(batch.media), batch.prompts, batch.metadata,
                                  latents=reward_latents(batch.final), group_ids=batch.group_ids)
                scores[name] = checked_scores(out, name, len(batch)).tolist()
                own = caption_texts(out.extras, len(batch))
                batch.reward_extras[f"{name}/caption"] = [" ".join([f"{name}={v:.2f}", *c.splitlines()])
                                                          for v, c in zip(scores[name], own, strict=True)]
        keys = [prompt_text(p) for p in batch.prompts]
        entry = history_entry(step, scores, keys, self.seed)
        metrics = {}
        for name in scores:
            metrics[f"eval/{name}"] = entry["means"][name]
            metrics[f"eval/{name}/ci95_lo"], metrics[f"eval/{name}/ci95_hi"] = entry["ci95"][name]
        if self.first is None:
            self.first = entry
        fallen = hacking_alarm([self.first, entry], self.reward_name)
        metrics["eval/hacking_alarm"] = float(bool(fallen))
        line = None
        if fallen and not self.warned:
            self.warned, line = True, alarm_line(fallen, self.reward_name)
        return metrics, line
