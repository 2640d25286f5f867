"""The files of a run directory that a person or a tool reads, by name, with the readers and the one small writer
that need no model code: the trainer writes these files, `polyrl view` reads them. A run written by an older version
may lack any of them but metrics.jsonl; a reader returns what is there.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .errors import UserError

METRICS = "metrics.jsonl"  # one JSON object per logged step
CONFIG = "config.yaml"  # the resolved config
STATUS = "status.json"  # the run's state: running, finished, stopped, failed (`write_status`)
SAMPLES = "samples"  # step_N.{png,mp4,wav,jsonl} of every evaluation, grid.json (which tiles the grids show)
EVAL = "eval"  # `polyrl eval` outputs of the run's checkpoints, one directory per evaluation
STATES = ("running", "finished", "stopped", "failed")


def read_metrics(path: Path) -> tuple[list[dict], str | None]:
    """The rows of a metrics.jsonl and a note when its last line was torn (a kill in the middle of a write: that
    line is dropped). A malformed line before the last is a UserError naming the file and line."""
    if not path.is_file():
        return [], None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows, note = [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not an object with an integer step")
        except ValueError as e:
            if n == len(lines):
                note = f"{path}:{n}: dropped a torn last line ({len(line)} characters)"
                break
            raise UserError(f"{path}:{n}: malformed metrics line ({e})") from None
        rows.append(row)
    return rows, note


class RunStatus:
    """`<run>/status.json`: {state, step, max_steps, pid, host, started, updated, error}, replaced whole (a temporary
    file renamed over it), so a reader never sees half of it. `started` is when this process began the run (a
    resumed run starts again). A write that fails (a full disk, a read-only directory) is skipped: the state is for
    people, the run's record is metrics.jsonl and its checkpoints."""

    def __init__(self, run_dir: Path, max_steps: int):
        self.path, self.max_steps = Path(run_dir) / STATUS, max_steps
        self.started = time.time()

    def write(self, state: str, step: int, error: str | None = None) -> None:
        if state not in STATES:
            raise ValueError(f"state {state!r} is not one of {STATES}")
        record = {"state": state, "step": step, "max_steps": self.max_steps, "pid": os.getpid(),
                  "host": socket.gethostname(), "started": self.started, "updated": time.time(), "error": error}
        tmp = self.path.with_name(STATUS + ".tmp")
        try:
            tmp.write_text(json.dumps(record) + "\n")
            tmp.replace(self.path)
        except OSError:
            pass


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None when the file is missing, unreadable or not a JSON object (a reader of a
    run that is being written sees such files before they are complete)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
