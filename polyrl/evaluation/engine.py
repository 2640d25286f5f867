"""`polyrl eval`: score a checkpoint (or a base model) on a prompt set with several scorers, paired against its base.

    polyrl eval checkpoint=<run>/checkpoints/step_N data.path=FILE eval.scorers=[shapes,pickscore] \\
        [eval.compare_base=true] [eval.samples_per_prompt=4] [scorer.pickscore.path=DIR ...] [overrides...]
    polyrl eval model.path=DIR data.path=FILE [recipe=...] eval.scorers=[...]        # a base model alone

Every prompt of the file (any format of data/benchmarks.py; `eval.format=` forces one) is sampled
`eval.samples_per_prompt` times, sample k of prompt p from its own seeded noise (`sample_seed`), with the
deterministic ODE sampler (`eval.noise_level=0`; > 0 samples the SDE with that noise level from the same seeds).
Each sample is scored with every scorer. With `eval.compare_base=true` the checkpoint's base model (its LoRA switched
off; a full fine-tune: the base loaded beside it) is sampled from the same noise and every statistic is paired per
sample (evaluation/stats.py). Sampling and scoring overlap: a worker thread scores a chunk while the next one samples.
A token policy (`model=causal_lm`, ...) decodes greedily (`eval.noise_level=0`; > 0: samples at that temperature
with `rollout.top_p`, sample k of prompt p from its own seeded uniforms) up to `rollout.max_new_tokens`; its
responses are kept in samples.jsonl and it writes no grids.

Output in `eval.output_dir` (default `<run>/eval/<timestamp>/`, or `runs/eval/<timestamp>/` for a base model):
`samples.jsonl` (each prompt's scores, written as each chunk is scored), `eval.json` (what was evaluated),
`report.json`, `report.md`, and grids of the largest gains and losses of the first scorer (`gains.png`,
`losses.png`; without a base, `best` / `worst`; video: also .mp4, audio: .wav + spectrogram). Re-running with the same
`eval.output_dir` resumes: prompts already in samples.jsonl are not sampled again.

Scorers: the run's reward (`reward.*` keys apply to it, as in training) and any registered reward, built from its
config/reward/<name>.yaml with `scorer.<name>.<key>=value` overrides.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import UserError
from .grids import write_grids
from .plan import EvalOptions, Models, eval_plan, load_eval_config, sample_chunk, score_all, token_eval_plan
from .report import build_report, check_same_run, fmt_ci, read_done, report_markdown


def run(checkpoint: str | None, opts: EvalOptions, extra: dict, overrides: list[str], args: list[str]) -> int:
    """Evaluate `checkpoint` (None: the base model of `overrides`' model.path) with `opts`; `extra`: the scorers'
    `scorer.<name>.<key>` overrides; `args`: the command's arguments, for the command that resumes an interrupted
    evaluation. Returns the exit code (130: interrupted)."""
    from tqdm import tqdm

    from ..config import ConfigError
    from ..config.schema import scorer_configs
    from ..data.benchmarks import read_benchmark
    from ..distributed.engine import pick_device
    from ..models import MODELS
    from ..models.base import policy_kind
    from ..rewards import build_reward
    from ..trainer.checkpoint import read_checkpoint

    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None:
        read_checkpoint(ckpt)  # every file checked before anything is loaded
    elif opts.compare_base:
        raise ConfigError("eval.compare_base=true compares a checkpoint with its base: give checkpoint=DIR")
    cfg = load_eval_config(ckpt, overrides)
    tokens = policy_kind(MODELS[cfg.model.name]) == "tokens"
    try:
        bench = read_benchmark(cfg.data.path, opts.format)
    except ValueError as e:  # the file's own problems, each message names the file (and line)
        raise UserError(str(e)) from None
    print(bench.describe(), file=sys.stderr)
    rows, fmt = bench.rows, bench.format
    if opts.max_prompts:
        rows = rows[: opts.max_prompts]
    names = list(opts.scorers or [cfg.reward.name])
    confs = scorer_configs(names, cfg, extra)  # eval.scorers / scorer.<name>.<key>
    plan = token_eval_plan(cfg.rollout, opts.noise_level) if tokens else eval_plan(cfg.rollout, opts.noise_level)
    spec = {"checkpoint": str(ckpt) if ckpt else None, "model_path": str(cfg.model.path),
            "data_path": str(cfg.data.path), "format": fmt, "scorers": names, "scorer_configs": confs,
            "samples_per_prompt": opts.samples_per_prompt, "seed": opts.seed, "compare_base": opts.compare_base,
            "noise_level": opts.noise_level, "total_prompts": len(rows)}
    if tokens:
        spec.update(policy="tokens", max_new_tokens=plan.max_new_tokens, top_p=plan.top_p, stop=list(plan.stop))
    else:
        spec.update(num_steps=plan.num_steps, guidance_scale=plan.guidance.scale, height=plan.shape.height,
                    width=plan.shape.width, num_frames=plan.shape.frames)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(opts.output_dir) if opts.output_dir else (
        ckpt.parent.parent / "eval" / stamp if ckpt else Path("runs") / "eval" / stamp)
    out.mkdir(parents=True, exist_ok=True)
    check_same_run(out / "eval.json", spec)
    samples_path = out / "samples.jsonl"
    done = read_done(samples_path)
    todo = [i for i in range(len(rows)) if i not in done]
    try:
        device = pick_device(cfg.trainer.device)
    except RuntimeError as e:
        raise UserError(str(e)) from None
    scorers = {}
    for name, conf in confs.items():
        try:
            scorers[name] = build_reward(conf, key=f"scorer.{name}")
        except TypeError as e:
            raise ConfigError(f"scorer {name}: {e}") from None
        if hasattr(scorers[name], "preflight"):  # a remote scorer's server answers before anything samples
            scorers[name].preflight()
    models = Models(cfg, ckpt, device, opts.compare_base)
    k = opts.samples_per_prompt
    per_chunk = opts.chunk_prompts or max(1, cfg.rollout.batch_size // k)
    resume = " ".join(shlex.quote(a) for a in ["polyrl", "eval", *args] if not a.startswith("eval.output_dir="))
    print(f"polyrl: evaluating {len(rows)} prompts × {k} samples with {', '.join(names)}"
          f"{' paired against the base' if opts.compare_base else ''} into {out}"
          f"{f' ({len(done)} prompts already done)' if done else ''}", file=sys.stderr)
    bar = tqdm(total=len(rows), initial=len(done), desc="polyrl eval", disable=not opts.progress, dynamic_ncols=True,
               unit="prompt")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyrl-eval-score")
    pending: list[Future] = []
    t0 = time.perf_counter()

    def score_and_write(chunk: list[int], trained, base) -> None:
        scores = score_all(scorers, *trained)
        base_scores = score_all(scorers, *base) if base is not None else None
        with samples_path.open("a") as f:
            for j, i in enumerate(chunk):
                sl = slice(j * k, (j + 1) * k)
                record = {"index": i, "prompt": rows[i]["prompt"], "category": rows[i].get("category"),
                          "scores": {n: v[sl] for n, v in scores.items()}}
                if base_scores is not None:
                    record["base"] = {n: v[sl] for n, v in base_scores.items()}
                if tokens and "text" in trained[0]:  # a token policy's responses (Janus-Pro's are images)
                    record["responses"] = trained[0]["text"][sl]
                    if base is not None:
                        record["base_responses"] = base[0]["text"][sl]
                f.write(json.dumps(record) + "\n")
        bar.update(len(chunk))

    try:
        for start in range(0, len(todo), per_chunk):
            chunk = todo[start: start + per_chunk]
            keys = [(i, s) for i in chunk for s in range(k)]
            base = sample_chunk(models, "base", plan, rows, keys, opts.seed) if opts.compare_base else None
            trained = sample_chunk(models, "trained", plan, rows, keys, opts.seed)
            while len(pending) >= 2:  # at most one chunk scored while the next samples: bounded memory
                pending.pop(0).result()
            pending.append(pool.submit(score_and_write, chunk, trained, base))
        for f in pending:
            f.result()
    except KeyboardInterrupt:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)
        bar.close()
        n = len(read_done(samples_path))
        print(f"polyrl: eval interrupted after {n} of {len(rows)} prompts; resume with: {resume} "
              f"eval.output_dir={shlex.quote(str(out))}", file=sys.stderr)
        return 130
    finally:
        pool.shutdown(wait=True)
        bar.close()
    records = sorted(read_done(samples_path).values(), key=lambda r: r["index"])
    report = build_report(spec, records, rows, opts)
    report["seconds"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    grids = write_grids(out, models, plan, rows, records, scorers, opts) if opts.grid and not tokens else []
    for name, s in report["scorers"].items():
        line = f"polyrl: {name}: mean {s['mean']:.4f} {fmt_ci(s['ci95'])}"
        if opts.compare_base:
            line += (f", base {s['base_mean']:.4f}, delta {s['delta']:+.4f} {fmt_ci(s['delta_ci95'])}, win rate "
                     f"{s['win_rate']:.3f}")
        print(line, file=sys.stderr)
    print(f"polyrl: wrote {out / 'report.json'}, {out / 'report.md'}"
          + "".join(f", {p}" for p in grids), file=sys.stderr)
    return 0
