"""Disk space: a full disk recognised however a library says it, one line that says what could not be written, and
the estimate that warns before the first checkpoint when the checkpoints a run will hold do not fit."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch

from ..errors import UserError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how the libraries that do not raise OSError say it: safetensors ("No space left on device (os error 28)"),
# torch.save's zip writer (a short write shows up as "unexpected pos N vs M", or "failed writing file")
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_TORCH_SHORT_WRITE = ("unexpected pos", "failed writing file")


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an exception it was raised from, is a full disk or an exhausted quota."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFull) or isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        text = str(error).lower()
        if any(t in text for t in _DISK_FULL_TEXT):
            return True
        if isinstance(error, RuntimeError) and any(t in text for t in _TORCH_SHORT_WRITE):
            return True
        error = error.__cause__ or error.__context__
    return False


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Free space (bytes an unprivileged writer may use) of the file system that holds `path`, or would hold it:
    the nearest existing ancestor is asked."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


class DiskFull(UserError):
    """A write that failed because the disk (or the quota) is full: one line naming what was written where, about
    how many bytes it needs, how many are free, and the last complete checkpoint (`resume`, when given, is the
    command that continues the run once space is freed)."""

    def __init__(self, path: Path, needed: int | None, last: Path | None, what: str = "checkpoint",
                 free: int | None = None, resume: str | None = None):
        self.path, self.needed, self.last, self.what, self.resume = Path(path), needed, last, what, resume
        self.free = free_bytes(path) if free is None else free
        need = f"needs about {human_bytes(needed)}, " if needed else ""
        last_note = f"the last complete checkpoint is {last}" if last else "no checkpoint has been written yet"
        then = f"; free space, then resume with: {resume}" if resume else "; free space and run again"
        super().__init__(f"disk full: could not write the {what} {path} ({need}{human_bytes(self.free)} free); "
                         f"{last_note}{then}")

    def with_resume(self, command: str) -> DiskFull:
        """The same error, saying the command that continues the run."""
        out = DiskFull(self.path, self.needed, self.last, self.what, self.free, command)
        out.__cause__ = self.__cause__
        return out


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a (nested) container."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def estimate_checkpoint_bytes(actor) -> int:
    """About the bytes of one checkpoint of `actor`, before any is written: its trainable weights, the EMA / old
    copy and the evaluation EMA when it keeps them, and AdamW's two float32 moments per trainable element
    (actor/local.py builds AdamW; before its first step the optimizer holds no state yet, so the moments are counted
    from the parameters), plus 32 KiB for the RNG states, the sampler and the small files (about 16 KiB measured).
    An upper estimate where the weights are saved in a narrower dtype."""
    params = list(actor.params)
    weights = tensor_bytes(params)
    old = tensor_bytes(list(getattr(actor, "old_params", None) or []))
    old += tensor_bytes(list(getattr(actor, "eval_params", None) or []))  # the evaluation EMA
    moments = sum(2 * 4 * p.numel() for p in params)
    return weights + old + moments + 32 * 1024


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the files of a checkpoint directory."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def checkpoints_to_write(step: int, max_steps: int, save_every: int) -> int:
    """How many checkpoints a run at `step` writes before `max_steps`: every `save_every` steps, and the last."""
    if save_every <= 0 or step >= max_steps:
        return 0
    regular = max_steps // save_every - step // save_every
    return regular + (max_steps % save_every != 0)


def checkpoints_held(to_write: int, keep: int | None, keep_best: bool = False) -> int:
    """How many of the run's new checkpoints are on disk at once: all of them without rotation, else the newest
    `keep`, the one being written, and the best one (`keep_best`) when it is not among the newest."""
    if keep is None:
        return to_write
    return min(to_write, keep + 1 + int(keep_best))


def space_warning(run_dir: Path, per_checkpoint: int, held: int, free: int | None = None) -> str | None:
    """A warning when the free space where `run_dir` lives cannot hold `held` checkpoints of `per_checkpoint`
    bytes (free: measured by `free_bytes` unless given), else None."""
    if held <= 0:
        return None
    free = free_bytes(run_dir) if free is None else free
    need = per_checkpoint * held
    if free >= need:
        return None
    return (f"polyrl: warning: {run_dir} has {human_bytes(free)} free, but the run will hold {held} checkpoint(s) of "
            f"about {human_bytes(per_checkpoint)} each ({human_bytes(need)}): free space, lower "
            "trainer.keep_checkpoints, or point trainer.output_dir at a larger disk")


def free_space_warning(run_dir: Path, actor, step: int, t) -> str | None:
    """Before the run's first checkpoint (`t`: the trainer config): a warning when the run directory's disk cannot
    hold the checkpoints the run will hold at once, their size estimated from the trainable weights and AdamW's
    state."""
    held = checkpoints_held(checkpoints_to_write(step, t.max_steps, t.save_every), t.keep_checkpoints, t.keep_best)
    return space_warning(run_dir, estimate_checkpoint_bytes(actor), held)


class OptionalWrites:
    """Writes a run can do without (samples, the reward curve, the compile cache): on a full disk each is skipped,
    with one warning for the whole run; any other failure is raised."""

    def __init__(self, say):
        self.say, self.skipped = say, False

    def __call__(self, what: str, write, *args) -> None:
        try:
            write(*args)
        except Exception as e:
            if not is_disk_full(e):
                raise
            if not self.skipped:
                self.skipped = True
                self.say(f"polyrl: warning: disk full: {what} not written ({e}); training goes on, and optional "
                         "files (samples, reward curve, compile cache) are skipped while the disk is full (said once)")


def exception_chain(error: BaseException | None):
    """`error` and the exceptions it was raised from."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def as_disk_full(error: BaseException, run_dir: Path, last: Path | None, resume: str) -> DiskFull:
    """The one-line error of a full disk: what could not be written, the last complete checkpoint (`last`), and the
    command that resumes the run once space is freed."""
    found = next((e for e in exception_chain(error) if isinstance(e, DiskFull)), None)
    if found is None:
        path = next((e.filename for e in exception_chain(error) if isinstance(e, OSError) and e.filename), run_dir)
        found = DiskFull(path, None, None, "file")
    return DiskFull(found.path, found.needed, last, found.what, resume=resume)
