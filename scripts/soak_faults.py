"""Faults that scripts/soak.py injects from inside a training process (`polyrl train --import scripts/soak_faults.py`),
chosen by the environment variable POLYRL_SOAK_FAULT=<kind>:<step>. Each fires once, at the first checkpoint write of
a step >= <step>:

    kill_weights   SIGKILL after the weight files are written, before trainer_state.pt
    kill_state     SIGKILL with half of trainer_state.pt written
    kill_fsync     SIGKILL with every file written and fsync'ed, before the rename of step_N.tmp to step_N
    kill_rotate    SIGKILL after rotation renamed an old checkpoint to step_N.del, before it is removed
    enospc         the trainer_state.pt write fails with ENOSPC (a full disk where the soak cannot mount a tmpfs)

and inside the first held-out evaluation of a step >= <step> (rank 0's, in a multi-rank run):

    eval_outage    the reward server (its pid read from POLYRL_SOAK_SERVER_PIDFILE) killed -9 as the evaluation starts
    eval_sigterm   SIGTERM to the launcher (torchrun, which signals every rank; one process: to itself) as the
                   evaluation starts; the hook then waits up to 3 s, in which the signal arrives
    eval_kill9     SIGKILL of this process as the evaluation starts
    eval_disk_full the disk filled as the evaluation's samples are written (POLYRL_SOAK_FILL=<filler file>:<bytes to
                   leave free>; without it the write fails with ENOSPC)

Nothing here changes a number the run computes: a fault only ends the process, or fails a write, at a chosen point.
"""

from __future__ import annotations

import errno
import io
import os
import pathlib
import shutil
import signal
import sys
import time

from polyrl.trainer import checkpoint as ck
from polyrl.trainer import evaluation, loop

_SPEC = os.environ.get("POLYRL_SOAK_FAULT", "")
KIND, _, _STEP = _SPEC.partition(":")
AT = int(_STEP) if _STEP else 0
_state = {"step": None, "fired": False}


def _die(where: str) -> None:
    print(f"soak_faults: SIGKILL {where} (step {_state['step']})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _armed() -> bool:
    return not _state["fired"] and _state["step"] is not None and _state["step"] >= AT


_trainer_state = ck.trainer_state


def trainer_state(actor, sampler, step, extra=None):
    _state["step"] = step  # called after the weights are written, before torch.save
    if KIND == "kill_weights" and _armed():
        _state["fired"] = True
        _die("after the weight files")
    return _trainer_state(actor, sampler, step, extra)


_save = ck.torch.save


def save(obj, f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and pathlib.Path(f).name == ck.STATE_FILE and _armed():
        if KIND == "kill_state":
            _state["fired"] = True
            buf = io.BytesIO()
            _save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
                out.flush()
                os.fsync(out.fileno())
            _die(f"with {len(data) // 2} of {len(data)} bytes of {f} written")
        if KIND == "enospc":
            _state["fired"] = True
            print(f"soak_faults: ENOSPC writing {f} (step {_state['step']})", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return _save(obj, f, *args, **kwargs)


_fsync = ck._fsync


def fsync(path):
    _fsync(path)
    if KIND == "kill_fsync" and pathlib.Path(path).name.endswith(".tmp") and _armed():
        _state["fired"] = True
        _die(f"before renaming {path}")


_rename = pathlib.Path.rename


def rename(self, target):
    out = _rename(self, target)
    if KIND == "kill_rotate" and str(target).endswith(".del") and _armed():
        _state["fired"] = True
        _die(f"after renaming {self} to {target}")
    return out


_evaluate = loop.Trainer.evaluate
MAIN = os.environ.get("RANK", "0") == "0"


def evaluate(self, n=None):
    _state["step"] = self.step
    if KIND.startswith("eval_") and KIND != "eval_disk_full" and MAIN and _armed():
        _state["fired"] = True
        print(f"soak_faults: {KIND} in the evaluation of step {self.step}", file=sys.stderr, flush=True)
        if KIND == "eval_kill9":
            _die("in an evaluation")
        elif KIND == "eval_outage":  # the server's pid now: a reward blip before may have restarted it
            pidfile = os.environ.get("POLYRL_SOAK_SERVER_PIDFILE")
            pid = int(pathlib.Path(pidfile).read_text()) if pidfile else int(os.environ["POLYRL_SOAK_SERVER_PID"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # down already
                pass
        elif KIND == "eval_sigterm":
            os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # the signal arrives here (or, when it may not abandon it, is noted)
                time.sleep(0.05)
    return _evaluate(self, n)


_write = evaluation.SampleFiles.write


def write(self, batch, step):
    _state["step"] = step
    if KIND == "eval_disk_full" and MAIN and _armed():
        _state["fired"] = True
        filler, _, leave = os.environ.get("POLYRL_SOAK_FILL", "").rpartition(":")
        print(f"soak_faults: the disk fills as the samples of step {step} are written", file=sys.stderr, flush=True)
        if not filler:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.dir))
        size = max(shutil.disk_usage(os.path.dirname(filler)).free - int(leave), 0)
        with open(filler, "ab") as f:
            try:
                while size > 0:
                    size -= f.write(b"\0" * min(size, 2**20))
                f.flush()
            except OSError:
                pass
    return _write(self, batch, step)


if KIND:
    known = ("kill_weights", "kill_state", "kill_fsync", "kill_rotate", "enospc", "eval_outage", "eval_sigterm",
             "eval_kill9", "eval_disk_full")
    if KIND not in known:
        raise SystemExit(f"soak_faults: unknown fault {KIND!r}; one of {', '.join(known)}")
    ck.trainer_state = trainer_state
    ck.torch.save = save
    ck._fsync = fsync
    pathlib.Path.rename = rename
    loop.Trainer.evaluate = evaluate
    evaluation.SampleFiles.write = write
