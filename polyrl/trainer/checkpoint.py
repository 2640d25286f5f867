"""Checkpoints: trainable weights (safetensors: LoRA adapter or full networks) + trainer state, written atomically.

Layout: `<run>/checkpoints/step_000010/` holding `adapter_model.safetensors` (LoRA) or `<network>.safetensors`
(full fine-tune), `old_weights.safetensors` (when the run keeps an EMA / old policy),
`eval_ema_weights.safetensors` (the evaluation EMA, `actor.eval_ema_decay`), `weights.json`, `trainer_state.pt`
(optimizer, prompt sampler position, step, RNG states) and `checksums.json` (size and SHA-256 of every other file).
Every other random draw is a function of (seed, step), so a resumed run continues exactly.

With sharded weights (`actor.backend=fsdp2`) every rank takes part: rank 0 writes the weight files above from
gathered tensors (LoRA: the adapter only) and the trainer state (with the optimizer's settings only), every rank
writes its shards of the weights, the EMA copies and the AdamW state into `distcp/` (torch.distributed.checkpoint),
which loads on any world size and into either backend; a checkpoint of the single-process format loads into
sharded weights too (actor/fsdp2.py). Checksums cover `distcp/`'s files as well.

Crash safety: a checkpoint is written into `step_N.tmp/`, every file and the directory are fsync'ed, then the
directory is renamed to `step_N` (a rename is atomic), so `step_N/` exists only once it is complete; a kill or a
full disk leaves at most a `.tmp` (or, while an existing `step_N` is being replaced, a `.old`) that resume ignores
and removes. Loading executes nothing: `trainer_state.pt` is read with `torch.load(weights_only=True)` (tensors,
numbers, strings and plain containers only; the numpy RNG state is stored as a list), weights are safetensors. A
checkpoint whose files are truncated, overwritten (checksum), unreadable or hold non-finite weights raises
`CheckpointError` naming the file; `load_newest` then falls back to the previous checkpoint and says so.

A full disk (ENOSPC / EDQUOT, or torch.save's `unexpected pos` RuntimeError, or safetensors' `No space left on
device`: `is_disk_full`) during a write raises `DiskFull`, one line naming the path, about how much the write needs,
how much is free and the last complete checkpoint. Rotation (`rotate_checkpoints`, trainer.keep_checkpoints /
trainer.keep_best) deletes old checkpoints only after a new one is complete and renamed: each is first renamed to
`step_N.del` (a kill mid-delete leaves a `.del`, never a half-deleted `step_N` that looks complete), then removed.
Before the first save the trainer compares `estimate_checkpoint_bytes` × the checkpoints the run will hold at once
with the free space of the run directory (`space_warning`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .disk import DiskFull, checkpoint_bytes, estimate_checkpoint_bytes, is_disk_full

STATE_FILE = "trainer_state.pt"
CHECKSUM_FILE = "checksums.json"
STEP_DIR = re.compile(r"step_(\d+)")
# a write in progress, a checkpoint being replaced, or one being deleted by rotation
STALE_DIR = re.compile(r"step_(\d+)\.(tmp|old|del)")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, truncated, corrupted, unsafe, or not of this model)."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def checkpoint_step(directory: Path) -> int:
    """The step of a `step_N` directory."""
    match = STEP_DIR.fullmatch(Path(directory).name)
    if match is None:
        raise CheckpointError(f"{directory} is not a checkpoint directory (expected a step_N directory)")
    return int(match.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, newest first (temp and replaced directories are not checkpoints)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(done, key=checkpoint_step, reverse=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[0] if found else None


def clean_stale(run_dir: Path) -> list[str]:
    """Remove what an interrupted save left behind; return one line per action. A `step_N.old` whose `step_N`
    is missing (a kill between the two renames of a replacement) is the last complete copy: it is put back."""
    root = Path(run_dir) / "checkpoints"
    actions = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = STALE_DIR.fullmatch(path.name)
        if match is None:
            continue
        target = path.with_name(f"step_{match.group(1)}")
        if match.group(2) == "old" and not target.exists():
            path.rename(target)
            actions.append(f"restored {target} from {path.name}")
        elif match.group(2) == "del":
            shutil.rmtree(path, ignore_errors=True)
            actions.append(f"removed {path} (a rotated-out checkpoint whose deletion was interrupted)")
        else:
            shutil.rmtree(path, ignore_errors=True)
            actions.append(f"removed the incomplete {path}")
    return actions


# ----------------------------------------------------------------------------------------------- write
def _numpy_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def rng_state() -> dict:
    """The process's global random states (torch CPU, python, numpy), weights_only-safe."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_state()}


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(_as_tuples(rng["python"]))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def trainer_state(actor, sampler, step: int, extra: dict | None = None) -> dict:
    """What `trainer_state.pt` holds: only tensors, numbers, strings and plain containers (weights_only-safe).
    `extra`: the trainer's own entries (`eval_due`: a step saved before its evaluation completed, trainer/loop.py)."""
    optimizer = actor.optimizer_state() if hasattr(actor, "optimizer_state") else actor.optimizer.state_dict()
    return {"step": step, "optimizer": optimizer, "sampler": sampler.state_dict(), "rng": rng_state(), **(extra or {})}


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, actor, sampler, step: int, extra: dict | None = None, engine=None,
                    keep: int | None = None, scores: dict[int, float] | None = None,
                    say: Callable[[str], None] | None = None) -> list[Path]:
    """Write the checkpoint of `step` to `directory` atomically (see the module docstring), then, once it is
    complete and renamed, rotate the run's checkpoints (`rotate_checkpoints` with `keep`, `scores`; returns the
    deleted ones). A failure removes the partial copy and deletes nothing; a full disk (`is_disk_full`) then
    raises DiskFull, another OSError CheckpointError, both naming the directory. With a sharding `engine` every
    rank calls it (each writes its shards; rank 0 the rest, then renames and rotates)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    sharded = engine is not None and engine.sharded
    if sharded and not engine.is_main:
        engine.barrier()  # rank 0 has cleared tmp
        actor.save_weights(tmp)
        engine.barrier()  # every shard is written
        return []
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        if sharded:
            engine.barrier()
        actor.save_weights(tmp)
        if sharded:
            engine.barrier()
        torch.save(trainer_state(actor, sampler, step, extra), tmp / STATE_FILE)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        sums = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files}
        (tmp / CHECKSUM_FILE).write_text(json.dumps({"files": sums}, indent=1))
        for p in [*files, tmp / CHECKSUM_FILE, *(d for d in tmp.rglob("*") if d.is_dir()), tmp]:
            _fsync(p)
        if directory.exists():  # replaced only after the new copy is complete on disk
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        _fsync(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # OSError; safetensors' SafetensorError and torch.save's RuntimeError on a short write
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(directory, actor) from e
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write checkpoint {directory}: {e}") from e
        raise
    return rotate_checkpoints(directory.parent.parent, step, keep, scores, say)


def disk_full_error(directory: Path, actor) -> DiskFull:
    """DiskFull for a checkpoint write to `directory`: the bytes needed are the newest complete checkpoint's size
    (else `estimate_checkpoint_bytes`), the last complete checkpoint is the run's newest."""
    last = latest_checkpoint(Path(directory).parent.parent)
    needed = checkpoint_bytes(last) if last is not None else estimate_checkpoint_bytes(actor)
    return DiskFull(directory, needed, last)


# ----------------------------------------------------------------------------------------------- rotation
def checkpoints_to_delete(steps: list[int], current: int, keep: int | None,
                          scores: dict[int, float] | None = None) -> list[int]:
    """The steps whose checkpoints rotation deletes once step `current`'s is written: of the checkpoints at or
    before `current`, all but the newest `keep` (`current` always among them) and, with `scores` (held-out reward
    by step), the best-scored one (ties: the earliest). None keeps all. Checkpoints after `current` (left by a run
    that resumed from an older one after a newer one failed to load) are not touched: training overwrites them."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (or None: keep all)")
    older = sorted((s for s in set(steps) if s <= current), reverse=True)
    kept = {current, *older[:keep]}
    scored = [s for s in older if scores and s in scores and math.isfinite(scores[s])]
    if scored:
        kept.add(max(scored, key=lambda s: (scores[s], -s)))
    return sorted(s for s in older if s not in kept)


def rotate_checkpoints(run_dir: Path, current: int, keep: int | None, scores: dict[int, float] | None = None,
                       say: Callable[[str], None] | None = None) -> list[Path]:
    """Delete what `checkpoints_to_delete` picks among the run's complete checkpoints; call it only after step
    `current`'s checkpoint is complete and renamed. Each is renamed to `step_N.del` first, then removed (a kill
    in between leaves a `.del` that `clean_stale` removes). A deletion that fails is reported through `say`
    and skipped. Returns the deleted directories."""
    if keep is None:
        return []
    by_step = {checkpoint_step(p): p for p in list_checkpoints(run_dir)}
    deleted = []
    for step in checkpoints_to_delete(list(by_step), current, keep, scores):
        path = by_step[step]
        doomed = path.with_name(path.name + ".del")
        try:
            shutil.rmtree(doomed, ignore_errors=True)
            path.rename(doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            if say is not None:
                say(f"polyrl: warning: could not delete the old checkpoint {path} ({e})")
            continue
        deleted.append(path)
    return deleted


# ----------------------------------------------------------------------------------------------- read
def verify_checksums(directory: Path) -> None:
    """Each file listed in checksums.json has its recorded size and SHA-256 (checkpoints written before
    checksums existed have no list and pass)."""
    listing = directory / CHECKSUM_FILE
    if not listing.is_file():
        return
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{listing}: unreadable ({e})") from None
    for name, want in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {CHECKSUM_FILE})")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, {want['bytes']} expected (truncated or overwritten)")
        if file_digest(path) != want["sha256"]:
            raise CheckpointError(f"{path}: contents do not match their SHA-256 in {CHECKSUM_FILE} (corrupted)")


def check_safetensors(path: Path) -> None:
    """The file parses and every floating-point tensor is finite (bytes overwritten in a float tensor often read
    back as NaN or inf)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    bad = int((~torch.isfinite(t)).sum())
                    raise CheckpointError(f"{path}: tensor {key} holds {bad} non-finite values (NaN/inf)")
    except CheckpointError:
        raise
    except Exception as e:  # SafetensorError, OSError, ...: any failure to parse is a bad file
        raise CheckpointError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None


def _check_finite(obj, where: str) -> None:
    if torch.is_tensor(obj):
        if obj.is_floating_point() and not torch.isfinite(obj).all():
            raise CheckpointError(f"{where} holds non-finite values (NaN/inf)")
    elif isinstance(obj, dict):
        for v in obj.values():
            _check_finite(v, where)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check_finite(v, where)


def read_checkpoint(directory: Path) -> dict:
    """The trainer state of a checkpoint after checking every file (checksums, safetensors, finite values);
    raises CheckpointError naming the file at fault. Nothing is applied."""
    directory = Path(directory)
    path = directory / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint directory (no {STATE_FILE})")
    verify_checksums(directory)
    for weights in sorted(directory.glob("*.safetensors")):
        check_safetensors(weights)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (also: a pickle that would run code), EOFError, RuntimeError (zip)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: unreadable or unsafe ({type(e).__name__}: {first})") from None
    missing = [k for k in ("step", "optimizer", "sampler", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a polyrl trainer state (missing {', '.join(missing)})")
    _check_finite(state["optimizer"], f"{path}: the optimizer state")
    return state


def load_checkpoint(directory: Path, actor, sampler) -> dict:
    """Check the checkpoint (`read_checkpoint`), then load it into the actor, the sampler and the RNGs."""
    directory = Path(directory)
    state = read_checkpoint(directory)
    try:
        actor.load_weights(directory)
        if hasattr(actor, "load_optimizer_state"):  # also a sharded one (distcp/), into either backend
            actor.load_optimizer_state(directory, state["optimizer"])
        else:
            actor.optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
    except (ValueError, KeyError, RuntimeError, OSError) as e:  # another model's or another config's checkpoint
        raise CheckpointError(f"{directory}: does not fit this run ({e})") from None
    set_rng_state(state["rng"])
    return state


def _as_tuples(obj):
    """random.setstate wants tuples where a round trip may give lists."""
    return tuple(_as_tuples(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


def load_newest(candidates: list[Path], actor, sampler, say: Callable[[str], None]) -> tuple[Path, dict]:
    """Load the first usable checkpoint of `candidates` (newest first); each unusable one is reported through
    `say` and the previous one is tried. CheckpointError when none can be used."""
    errors = []
    for i, directory in enumerate(candidates):
        try:
            return directory, load_checkpoint(directory, actor, sampler)
        except CheckpointError as e:
            errors.append(str(e))
            nxt = f"falling back to {candidates[i + 1]}" if i + 1 < len(candidates) else "no older checkpoint left"
            say(f"polyrl: checkpoint {directory} cannot be loaded: {e}; {nxt}")
    raise CheckpointError("no usable checkpoint: " + "; ".join(errors))
