"""What `polyrl view` knows about run directories, read from their files alone (run_files.py names them): which
directories under the roots are runs or `polyrl eval` outputs, each run's summary (recipe, model, algorithm, seed,
steps, state, wall time, alarms), its metrics, its held-out samples, and each evaluation's report.

Everything here reads; nothing opens a file for writing. A file that is missing, half written or malformed makes
the answer smaller (a note says why), never an error: the page polls runs that are being written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path

from ..errors import UserError
from ..run_files import CONFIG, EVAL, METRICS, SAMPLES, STATUS, read_json, read_metrics

SKIP_DIRS = {"checkpoints", "tensorboard", SAMPLES, "wandb", "mlruns", "__pycache__", "node_modules"}
MAX_DEPTH = 6  # how deep under a root runs are looked for (runs/<name>/<timestamp>/eval/<timestamp> is 4)
# what runs that differ only in their seed may still differ in: where they write and how they show progress
NOT_THE_CONFIG = {"trainer.seed", "trainer.output_dir", "trainer.resume", "trainer.progress"}
SAMPLE_FILE = re.compile(r"step_(\d+)\.(png|mp4|wav|jsonl)$")
EVAL_MEDIA = re.compile(r"(gains|losses|best|worst)\.(png|mp4|wav)$")
QUIET_SECONDS = 600  # a run without status.json whose metrics changed this recently is taken to be running


def find(roots: list[Path]) -> tuple[list[str], list[str]]:
    """(run ids, evaluation ids) under the roots, in path order. An id is `<root index>/<path under the root>` (the
    root itself: `<root index>`). A run directory holds metrics.jsonl, config.yaml or status.json; an evaluation's
    holds report.json or eval.json. Symbolic links to directories are not followed; checkpoints, TensorBoard
    events and sample folders are not searched."""
    runs, evals = [], []
    for k, root in enumerate(roots):
        for here, dirs, files in os.walk(root):
            rel = os.path.relpath(here, root)
            depth = 0 if rel == "." else rel.count(os.sep) + 1
            ident = str(k) if rel == "." else f"{k}/{Path(rel).as_posix()}"
            names = set(files)
            if names & {METRICS, CONFIG, STATUS}:
                runs.append(ident)
            if names & {"report.json", "eval.json"}:
                evals.append(ident)
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if depth < MAX_DEPTH and not d.startswith(".") and d not in SKIP_DIRS
                             and not os.path.islink(os.path.join(here, d)))
    return runs, evals


def load_config(path: Path) -> dict:
    """config.yaml as a dict ({} when missing or unreadable)."""
    import yaml

    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def seed_group(config: dict) -> str | None:
    """A key equal for runs whose configs differ only in `trainer.seed` (and in NOT_THE_CONFIG); None without a
    config."""
    if not config:
        return None
    kept = {k: v for k, v in flat(config).items() if k not in NOT_THE_CONFIG}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def pid_alive(pid) -> bool:
    """Whether a process of this id exists on this machine (a signal 0 only asks)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError, TypeError):
        return isinstance(pid, int)
    return True


def run_state(status: dict | None, last_step: int | None, max_steps, metrics_mtime: float | None,
              now: float) -> tuple[str, str]:
    """(state, a note): running, finished, stopped or failed. status.json says it (the trainer writes it when a run
    starts and when it ends); `running` whose process is gone from this machine is `failed` (killed: it could not
    say so). A run without status.json (an older version) is finished when its metrics reach trainer.max_steps,
    running when they changed in the last QUIET_SECONDS, else stopped."""
    if status and status.get("state") in ("running", "finished", "stopped", "failed"):
        state, note = status["state"], status.get("error") or ""
        if state == "running" and status.get("host") == socket.gethostname() and not pid_alive(status.get("pid")):
            return "failed", f"its process {status.get('pid')} is gone without a last word (killed?)"
        if state == "running" and status.get("host") != socket.gethostname():
            note = f"on {status.get('host')}"
        return state, note
    if isinstance(max_steps, int) and last_step is not None and last_step >= max_steps:
        return "finished", ""
    if metrics_mtime is not None and now - metrics_mtime < QUIET_SECONDS:
        return "running", "no status.json: its metrics changed in the last 10 minutes"
    return "stopped", "no status.json: it ended before trainer.max_steps"


def sample_files(run_dir: Path) -> dict[int, dict[str, str]]:
    """{step: {extension: path under the run}} of samples/step_N.{png,mp4,wav,jsonl}."""
    out: dict[int, dict[str, str]] = {}
    try:
        names = os.listdir(run_dir / SAMPLES)
    except OSError:
        return out
    for name in names:
        m = SAMPLE_FILE.fullmatch(name)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = f"{SAMPLES}/{name}"
    return dict(sorted(out.items()))


def read_jsonl(path: Path, limit: int = 100_000) -> list[dict]:
    """The JSON objects of a .jsonl file (at most `limit`); a line that is not one (torn) is skipped."""
    rows = []
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
                if len(rows) >= limit:
                    break
    except OSError:
        pass
    return rows


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class Reader:
    """The roots and a cache of parsed metrics (re-read when a file's size or time changes)."""

    def __init__(self, roots: list[Path]):
        self.roots = [Path(os.path.realpath(r)) for r in roots]
        self._metrics: dict[Path, tuple[tuple, list[dict], str | None]] = {}

    def path_of(self, ident: str) -> Path | None:
        """The directory of an id from `find`, or None when the id is not one (checked the way files are)."""
        from .paths import resolve

        return resolve(self.roots, ident, want_dir=True)

    def metrics(self, run_dir: Path) -> tuple[list[dict], str | None]:
        path = run_dir / METRICS
        try:
            st = path.stat()
        except OSError:
            return [], None
        key = (st.st_size, st.st_mtime_ns)
        cached = self._metrics.get(path)
        if cached and cached[0] == key:
            return cached[1], cached[2]
        try:
            rows, note = read_metrics(path)
        except UserError as e:
            rows, note = [], str(e)
        rows = [r for r in rows if isinstance(r.get("step"), int)]
        self._metrics[path] = (key, rows, note)
        return rows, note

    def label(self, ident: str) -> str:
        k, _, rel = ident.partition("/")
        root = self.roots[int(k)]
        return f"{root.name}/{rel}" if rel else root.name

    def run_summary(self, ident: str, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        d = self.path_of(ident)
        config = load_config(d / CONFIG)
        rows, note = self.metrics(d)
        status = read_json(d / STATUS)
        t = config.get("trainer") or {}
        max_steps = t.get("max_steps", (status or {}).get("max_steps"))
        last = rows[-1]["step"] if rows else None
        metrics_mtime = _mtime(d / METRICS)
        state, state_note = run_state(status, last, max_steps, metrics_mtime, now)
        wall = sum(float(r.get(k, 0) or 0) for r in rows for k in ("time/step", "time/eval")
                   if isinstance(r.get(k), (int, float)))
        evals = [r for r in rows if isinstance(r.get("eval/reward_mean"), (int, float))]
        samples = sample_files(d)
        st = (d / METRICS).stat() if metrics_mtime is not None else None
        return {
            "id": ident, "label": self.label(ident),
            "recipe": config.get("name"), "model": (config.get("model") or {}).get("name"),
            "algorithm": (config.get("algorithm") or {}).get("name"), "reward": (config.get("reward") or {}).get("name"),
            "seed": t.get("seed"), "max_steps": max_steps, "step": last, "state": state, "state_note": state_note,
            "metrics_note": note, "wall_seconds": wall, "group": seed_group(config),
            "heldout_first": evals[0]["eval/reward_mean"] if evals else None,
            "heldout_last": evals[-1]["eval/reward_mean"] if evals else None,
            "alarms": [r["step"] for r in rows if isinstance(r.get("eval/hacking_alarm"), (int, float))
                       and r["eval/hacking_alarm"] > 0],
            "sample_steps": [s for s, files in samples.items() if files],
            # what the page compares to know what to fetch again
            "version": f"{st.st_size}:{st.st_mtime_ns}:{len(samples)}" if st else f"0:0:{len(samples)}",
        }

    def samples(self, ident: str) -> dict:
        """{"steps": [{step, files: {ext: path under the run}, rows: [jsonl rows]}], "grid": grid.json or None}."""
        d = self.path_of(ident)
        steps = []
        for step, files in sample_files(d).items():
            rows = read_jsonl(d / files["jsonl"]) if "jsonl" in files else []
            steps.append({"step": step, "files": files, "rows": rows})
        return {"steps": steps, "grid": read_json(d / SAMPLES / "grid.json")}

    def eval_summary(self, ident: str) -> dict:
        """An evaluation directory: its report.json (None while it runs), what it evaluates (eval.json), how many
        prompts are done, its grids, and the run it belongs to (`<run>/eval/<timestamp>`)."""
        d = self.path_of(ident)
        report, spec = read_json(d / "report.json"), read_json(d / "eval.json")
        done = 0
        try:
            with (d / "samples.jsonl").open("rb") as f:
                done = sum(1 for line in f if line.strip())
        except OSError:
            pass
        try:
            media = sorted(n for n in os.listdir(d) if EVAL_MEDIA.fullmatch(n))
        except OSError:
            media = []
        parent = ident.rsplit("/", 2)
        run = parent[0] if len(parent) == 3 and parent[1] == EVAL else None
        if run is not None and self.path_of(run) is not None and not (self.path_of(run) / CONFIG).is_file():
            run = None
        return {"id": ident, "label": self.label(ident), "report": report, "spec": spec, "done": done,
                "total": (spec or report or {}).get("total_prompts"), "media": media, "run": run}
