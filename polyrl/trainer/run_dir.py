"""Where a run lives: a new run directory, or the run and checkpoints that `trainer.resume` continues, the command
that continues a stopped run, and the state its status.json records (run_files.RunStatus)."""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig

from ..errors import UserError
from ..run_files import RunStatus
from .checkpoint import STATE_FILE, CheckpointError, checkpoint_step, clean_stale, list_checkpoints
from .recovery import RunStopped


def resolve_run_dir(cfg: DictConfig) -> tuple[Path, list[Path], list[str]]:
    """(run directory, checkpoints to resume from (newest first; empty: a fresh start), lines to tell the user).

    `trainer.resume=auto` continues `trainer.output_dir`, or else the newest run of `runs/<name>/`; when that newest
    run has no checkpoint but an older one has, which one is meant is ambiguous and it refuses, naming the runs.
    Leftovers of an interrupted checkpoint write in the chosen run are cleaned first (`clean_stale`).
    """
    t = cfg.trainer
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # torchrun --max-restarts
    if t.resume not in (None, "auto"):
        ckpt = Path(t.resume)
        if not (ckpt / STATE_FILE).is_file():
            raise CheckpointError(f"trainer.resume={t.resume!r} is not a checkpoint directory (no {STATE_FILE})")
        checkpoint_step(ckpt)
        return ckpt.parent.parent, [ckpt], []
    if t.output_dir is not None:
        run_dir = Path(t.output_dir)
        notes = [f"polyrl: {line}" for line in clean_stale(run_dir)]
        found = list_checkpoints(run_dir)
        if found and t.resume is None:
            raise FileExistsError(
                f"trainer.output_dir={str(run_dir)!r} already holds a run; pass trainer.resume=auto to continue it, "
                "or choose another trainer.output_dir"
            )
        if t.resume == "auto" and not found:
            notes.append(f"polyrl: trainer.resume=auto: {run_dir} has no checkpoint yet; starting at step 0")
        return run_dir, found, notes
    root = Path("runs") / cfg.name
    runs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    notes = []
    if t.resume == "auto":
        if runs:
            newest = runs[-1]
            notes = [f"polyrl: {line}" for line in clean_stale(newest)]
            found = list_checkpoints(newest)
            if found or restarted:  # a restart by torchrun continues the run it restarts, checkpoint or not
                return newest, found, notes
            older = [(r, list_checkpoints(r)) for r in runs[:-1]]
            older = [f"{r} (step {checkpoint_step(c[0])})" for r, c in older if c]
            if older:
                raise UserError(
                    f"trainer.resume=auto is ambiguous: the newest run of {cfg.name}, {newest}, has no checkpoint "
                    f"(it stopped before its first save, or is still running), but older runs have: "
                    f"{', '.join(older[::-1])}. Continue one with trainer.output_dir=<run> trainer.resume=auto, "
                    f"or start afresh without trainer.resume"
                )
        notes.append(f"polyrl: trainer.resume=auto: no run of {cfg.name} under {root} has a checkpoint; "
                     "starting a new run")
    return root / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), [], notes


def resolve_on_main(engine, cfg: DictConfig) -> tuple[Path, list[Path], list[str]]:
    """Rank 0 resolves the run directory (its clock names a new run) and every rank uses its answer or error."""
    answer = None
    if engine.is_main:
        try:
            answer = resolve_run_dir(cfg)
        except (UserError, FileNotFoundError, FileExistsError) as e:
            answer = e
    answer = engine.broadcast_object(answer)
    if isinstance(answer, Exception):
        raise answer
    return answer


def launch_command(world_size: int, argv: list[str] | None = None, parent: list[str] | None = None) -> list[str]:
    """How this process was started, up to the `train` subcommand: `["polyrl"]` for one process; under torchrun
    the launcher and its arguments as typed (read from the parent's command line, the torchrun agent's, whose
    tail is this rank's `train ...`; `torchrun` for the console script), else a torchrun line rebuilt from the
    environment. `argv` / `parent`: this process's and its parent's arguments (default: read them)."""
    if world_size <= 1:
        return ["polyrl"]
    argv = sys.argv if argv is None else argv
    if parent is None:
        try:
            parent = [a for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0") if a]
        except (OSError, UnicodeDecodeError):
            parent = []
    tail = argv[1:]
    if tail and tail[0] == "train" and len(parent) > len(tail) and parent[-len(tail):] == tail:
        prefix = parent[: len(parent) - len(tail)]
        if len(prefix) > 1 and Path(prefix[0]).name.startswith("python") and Path(prefix[1]).name == "torchrun":
            prefix = ["torchrun", *prefix[2:]]  # the console script through its interpreter (the shebang line)
        return prefix
    nodes = max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    return ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []),
            f"--nproc-per-node={world_size // nodes}", "-m", "polyrl"]


def resume_command(overrides: list[str], run_dir: Path, launcher: list[str] | None = None) -> str:
    """The command that continues this run: its launcher (`launch_command`; `polyrl` by default), the same
    overrides pinned to its directory, trainer.resume=auto."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("trainer.resume=", "trainer.output_dir="))]
    args = [*(launcher or ["polyrl"]), "train", *keep, f"trainer.output_dir={run_dir}", "trainer.resume=auto"]
    return " ".join(shlex.quote(a) for a in args)


def write_outcome(status: RunStatus, step: int, error: BaseException | None) -> None:
    """status.json when a run's fit ends: finished (no error), stopped (a signal: RunStopped) or failed (any other
    error, its type and first line kept)."""
    if error is None:
        status.write("finished", step)
    else:
        first = (str(error).splitlines() or [""])[0]
        status.write("stopped" if isinstance(error, RunStopped) else "failed", step, f"{type(error).__name__}: {first}")
