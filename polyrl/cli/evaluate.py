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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import UserError

USAGE = ("usage: polyrl eval checkpoint=<run>/checkpoints/step_N | model.path=DIR  data.path=FILE "
         "[eval.scorers=[NAME,...]] [eval.compare_base=true] [eval.samples_per_prompt=K] [eval.output_dir=DIR] "
         "[scorer.NAME.KEY=VALUE ...] [overrides...]")


@dataclass
class EvalOptions:
    scorers: list | None = None  # None: the run's reward
    samples_per_prompt: int = 1
    seed: int = 0
    compare_base: bool = False
    output_dir: str | None = None
    format: str | None = None  # a data/benchmarks.py format; None: detected from the file
    noise_level: float = 0.0  # 0: the deterministic ODE sampler
    resamples: int = 1000  # bootstrap resamples of every ci95
    grid: int = 8  # samples in each of the gains / losses grids (0: none)
    chunk_prompts: int = 0  # prompts sampled per chunk; 0: rollout.batch_size // samples_per_prompt
    max_prompts: int = 0  # 0: every prompt of the file
    progress: bool = True
    extra: dict = field(default_factory=dict)  # not a key: scorer.<name>.<key> overrides land here


def parse_args(args: list[str]) -> tuple[str | None, EvalOptions, dict, list[str]]:
    """(checkpoint, eval options, per-scorer overrides {name: {key: value}}, the config overrides)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ..config import ConfigError

    checkpoint, eval_args, scorer_args, rest = None, [], [], []
    for a in args:
        key, sep, value = a.partition("=")
        if key == "checkpoint" and value:
            checkpoint = value
        elif key.startswith("eval.") and sep:
            eval_args.append(a)
        elif key.startswith("scorer.") and sep:
            scorer_args.append(a)
        else:
            rest.append(a)
    allowed = [k for k in EvalOptions.__dataclass_fields__ if k != "extra"]
    try:
        given = OmegaConf.from_dotlist(eval_args).get("eval", {})
        unknown = [k for k in given if k not in allowed]
        if unknown:
            raise ConfigError(f"unknown key eval.{unknown[0]}; allowed: {', '.join(sorted(allowed))}")
        merged = OmegaConf.merge(OmegaConf.structured(EvalOptions), given)
        scorers_cfg = OmegaConf.to_container(OmegaConf.from_dotlist(scorer_args)).get("scorer", {})
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"bad value for {'eval.' + key if key else 'an eval option'}: "
                          f"{str(e).splitlines()[0]}") from None
    opts = EvalOptions(**OmegaConf.to_container(merged))
    if isinstance(opts.scorers, str):
        opts.scorers = [opts.scorers]
    for key in ("samples_per_prompt", "resamples"):
        if getattr(opts, key) < 1:
            raise ConfigError(f"eval.{key}={getattr(opts, key)} must be >= 1")
    for key in ("grid", "chunk_prompts", "max_prompts"):
        if getattr(opts, key) < 0:
            raise ConfigError(f"eval.{key}={getattr(opts, key)} must be >= 0")
    if opts.noise_level < 0:
        raise ConfigError(f"eval.noise_level={opts.noise_level} must be >= 0 (0: the deterministic ODE sampler)")
    if opts.scorers is not None and (not opts.scorers or not all(isinstance(s, str) and s for s in opts.scorers)):
        raise ConfigError(f"eval.scorers={opts.scorers} must be a non-empty list of reward names")
    return checkpoint, opts, scorers_cfg, rest


def load_eval_config(checkpoint: Path | None, overrides: list[str]):
    """The config: the checkpoint's run config with the overrides (as `polyrl sample`), or, for a base model, the
    composed config (`recipe=`, `model=` ... as `polyrl train`)."""
    from omegaconf import OmegaConf

    from ..config import load_config, validate

    # the evaluation samples every step alike (eval_plan): the training SDE window is not used, and a smaller
    # rollout.num_steps must not fail the training config's window checks
    overrides = [*overrides, "rollout.sde_window_size=0"]
    if checkpoint is None:
        if not any(o.startswith("model.path=") for o in overrides):
            raise UserError(f"polyrl eval: checkpoint=DIR or model.path=DIR is required; {USAGE}")
        return load_config(overrides)
    run_cfg = checkpoint.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise UserError(f"polyrl eval: {run_cfg} not found (is {checkpoint} inside a polyrl run directory?)")
    return validate(OmegaConf.merge(OmegaConf.load(run_cfg), OmegaConf.from_dotlist(overrides)))


def eval_plan(r, noise_level: float):
    """The rollout config's sampling plan, made deterministic (noise level 0) or SDE at `noise_level` everywhere,
    with no trained window (every step sampled alike)."""
    from ..latents import MediaShape
    from ..models.base import Guidance
    from ..sampling.diffusion import SamplingPlan

    return SamplingPlan(
        num_steps=r.num_steps, shape=MediaShape(height=r.height, width=r.width, frames=r.num_frames, fps=r.fps),
        guidance=Guidance(r.guidance_scale, r.negative_prompt), noise_level=noise_level, window_size=0,
        batch_size=r.batch_size, step=r.step, log_density=r.log_density, training_graph=False)


def sample_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt_index`: fixed by the prompt's place in the file alone, so a
    resumed or re-chunked evaluation, and the base model, draw the same noise for it."""
    return (seed * 1_000_003 + prompt_index) * 4096 + sample


def draw_samples_noise(adapter, plan, keys: list[tuple[int, int]], seed: int):
    """The noise of samples `keys` ((prompt index, sample) each), one seeded draw per sample, concatenated."""
    from ..sampling.diffusion import RolloutNoise, draw_noise

    shapes = adapter.latent_shapes(plan.shape)
    parts = [draw_noise(shapes, plan, torch.zeros(1, dtype=torch.long),
                        torch.Generator().manual_seed(sample_seed(seed, p, k))) for p, k in keys]
    return RolloutNoise({n: torch.cat([x.initial[n] for x in parts]) for n in shapes},
                        torch.cat([x.starts for x in parts]),
                        {n: torch.cat([x.steps[n] for x in parts], dim=1) for n in shapes})


class Models:
    """The checkpoint's model and, for `compare_base`, its base: the same networks with the LoRA switched off, or
    (a full fine-tune) a second copy loaded from the base directory."""

    def __init__(self, cfg, checkpoint: Path | None, device, compare_base: bool):
        from ..actor.local import load_trained_weights
        from ..models import build_model

        self.trained = build_model(cfg.model, device)
        self.lora = False
        self.base = None
        if checkpoint is not None:
            load_trained_weights(self.trained, checkpoint)
            self.lora = bool(json.loads((checkpoint / "weights.json").read_text()).get("lora"))
            if compare_base and not self.lora:
                self.base = build_model(cfg.model, device)
        for network in self.trained.modules().values():
            network.eval()

    def get(self, which: str):
        """The adapter that samples `which` ("trained" or "base")."""
        if which == "base" and self.base is not None:
            return self.base
        if self.lora:
            from ..actor.local import set_adapters_enabled

            for network in self.trained.modules().values():
                set_adapters_enabled(network, which == "trained")
        return self.trained


def token_eval_plan(r, temperature: float):
    """A token policy's evaluation plan: the run's `rollout.*` keys at `temperature` (0: greedy decoding)."""
    from dataclasses import replace

    from ..sampling.tokens import token_plan_from_config

    return replace(token_plan_from_config(r), temperature=temperature)


def sample_chunk(models: Models, which: str, plan, rows: list[dict], keys: list[tuple[int, int]], seed: int):
    """Decoded samples of `keys` ((prompt index, sample) each) with `which` model: (media, final latents, prompts,
    metadata, group ids: the prompt indices; a chunk holds every sample of its prompts, whole groups for a group
    reward). A token policy's media are its responses ({"text": [...]}) and it has no latents."""
    from ..data.prompts import split_row
    from ..sampling.diffusion import rollout
    from ..sampling.tokens import TokenPlan, draw_uniforms, token_rollout

    adapter = models.get(which)
    prompts, metadata = zip(*(split_row(rows[p]) for p, _ in keys), strict=True)
    group_ids = torch.tensor([p for p, _ in keys])
    with torch.no_grad():
        if isinstance(plan, TokenPlan):
            uniforms = torch.cat([draw_uniforms(1, plan, torch.Generator().manual_seed(sample_seed(seed, p, k)))
                                  for p, k in keys])
            batch = token_rollout(adapter, list(prompts), list(metadata), group_ids, plan, uniforms)
        else:
            batch = rollout(adapter, list(prompts), list(metadata), group_ids, plan,
                            draw_samples_noise(adapter, plan, keys, seed))
    return batch.media, batch.final, list(prompts), list(metadata), batch.group_ids


def score_all(scorers: dict, media, final, prompts, metadata, group_ids) -> dict[str, list[float]]:
    from ..media import primary
    from ..rewards.base import call_reward
    from ..rewards.stage import checked_scores, reward_latents

    out = {}
    with torch.no_grad():
        for name, reward in scorers.items():
            result = call_reward(reward, primary(media), prompts, metadata, latents=reward_latents(final),
                                 group_ids=group_ids)
            out[name] = checked_scores(result, name, len(prompts)).tolist()
    return out


def read_done(path: Path) -> dict[int, dict]:
    """The prompts samples.jsonl already holds, by index; a torn last line (a kill mid-write) is dropped."""
    done = {}
    if not path.is_file():
        return done
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise UserError(f"{path}:{n}: not valid JSON (the file was edited?); remove it to start afresh") from None
        done[int(record["index"])] = record
    # rewrite without the torn line, so appends start on a line of their own
    path.write_text("".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
    return done


def check_same_run(path: Path, spec: dict) -> None:
    """Resuming into `path` (eval.json) is only allowed for the same evaluation."""
    if not path.is_file():
        path.write_text(json.dumps(spec, indent=2) + "\n")
        return
    old = json.loads(path.read_text())
    differ = [k for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k)]
    if differ:
        k = differ[0]
        raise UserError(f"{path.parent} holds another evaluation ({k}: {old.get(k)!r} there, {spec.get(k)!r} now); "
                        "choose another eval.output_dir")


def build_report(spec: dict, records: list[dict], rows: list[dict], opts: EvalOptions) -> dict:
    """report.json: what was evaluated, counts, and per scorer the statistics of evaluation/stats.py (per category
    where the prompt set has categories)."""
    from ..evaluation.stats import summarize_by_category

    categories = [rows[r["index"]].get("category") for r in records]
    report = {**spec, "prompts": len(records), "samples": len(records) * opts.samples_per_prompt, "scorers": {}}
    for name in spec["scorers"]:
        scores = [r["scores"][name] for r in records]
        base = [r["base"][name] for r in records] if opts.compare_base else None
        report["scorers"][name] = summarize_by_category(scores, categories, opts.seed, opts.resamples, base)
    return report


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def report_markdown(report: dict) -> str:
    paired = report["compare_base"]
    head = ("| scorer | mean | ci95 | base | delta | delta ci95 | win rate |\n|---|---|---|---|---|---|---|"
            if paired else "| scorer | mean | ci95 |\n|---|---|---|")

    def row(label: str, s: dict) -> str:
        cells = [label, f"{s['mean']:.4f}", _fmt_ci(s["ci95"])]
        if paired:
            cells += [f"{s['base_mean']:.4f}", f"{s['delta']:+.4f}", _fmt_ci(s["delta_ci95"]), f"{s['win_rate']:.3f}"]
        return "| " + " | ".join(cells) + " |"

    what = report["checkpoint"] or report["model_path"]
    lines = [f"# polyrl eval: {what}", "",
             f"{report['prompts']} prompts × {report['samples_per_prompt']} samples = {report['samples']} samples of "
             f"`{report['data_path']}` ({report['format']}), seed {report['seed']}, {_sampling_words(report)}"
             + (f"; paired against the base `{report['model_path']}` from the same noise" if paired else "") + ".",
             "", head]
    lines += [row(name, s) for name, s in report["scorers"].items()]
    for name, s in report["scorers"].items():
        if "categories" not in s:
            continue
        lines += ["", f"## {name} per category", "", head.replace("| scorer |", "| category |")]
        lines += [row(c, cs) for c, cs in s["categories"].items()]
        mean_line = f"mean over categories: {s['category_mean']:.4f}"
        if paired:
            mean_line += f" (base {s['base_category_mean']:.4f}, delta {s['category_delta']:+.4f})"
        lines += ["", mean_line]
    lines += ["", "ci95: bootstrap over prompts (docs/evaluation.md); win rate: (wins + ties/2) / paired samples."]
    return "\n".join(lines) + "\n"


def _sampling_words(report: dict) -> str:
    level = report["noise_level"]
    if report.get("policy") == "tokens":
        return (("greedy decoding" if level == 0 else f"sampling at temperature {level}")
                + f", at most {report['max_new_tokens']} new tokens")
    return f"{'ODE' if level == 0 else 'SDE noise level ' + str(level)} sampling, {report['num_steps']} steps"


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


def main(args: list[str]) -> int:
    from tqdm import tqdm

    from ..config import ConfigError
    from ..config.schema import scorer_configs
    from ..data.benchmarks import read_benchmark
    from ..distributed.engine import pick_device
    from ..models import MODELS
    from ..models.base import policy_kind
    from ..rewards import build_reward
    from ..trainer.checkpoint import read_checkpoint

    if any(a in ("-h", "--help") for a in args):
        print(USAGE + "\n\n" + __doc__)
        return 0
    checkpoint, opts, extra, overrides = parse_args(args)
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
                if tokens:  # a token policy's responses (media {"text": [...]})
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
        line = f"polyrl: {name}: mean {s['mean']:.4f} {_fmt_ci(s['ci95'])}"
        if opts.compare_base:
            line += (f", base {s['base_mean']:.4f}, delta {s['delta']:+.4f} {_fmt_ci(s['delta_ci95'])}, win rate "
                     f"{s['win_rate']:.3f}")
        print(line, file=sys.stderr)
    print(f"polyrl: wrote {out / 'report.json'}, {out / 'report.md'}"
          + "".join(f", {p}" for p in grids), file=sys.stderr)
    return 0
