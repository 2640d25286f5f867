"""How a run stops: a signal (SIGINT / SIGTERM), a failure of its own, or another rank that exited; what it saves
first, and the one message it prints, which ends with the command that resumes it (the launcher it was started
with: `polyrl`, or torchrun and its arguments, `run_dir.launch_command`).

A mixin of `Trainer` (trainer/loop.py): it reads the trainer's state (step, phase, pending metrics, snapshot) and
saves through `_save`.

With several ranks (torchrun), a signal stops them together: they agree once per step (`_stop_agreed`) and stop
after the same step, which rank 0 saves. A failure is one rank's: rank 0 saves the last completed step (the
local backend holds every weight on every rank; sharded weights need every rank, so their last complete checkpoint
stays the resume point) and prints the message; another rank leaves its reason in the store (`PeerWatch.publish`)
and exits without a word. A rank that dies (kill -9, the OOM killer) is seen by the others through its pid
(distributed/peers.py): its collectives fail, or the SIGTERM torchrun then sends arrives, and the lowest surviving
rank prints `polyrl: stopped: rank R (pid P) exited (signal 9) at step k of N; saved ...`, no traceback. Under
`torchrun --max-restarts N` the message says that torchrun restarts the run from there while restarts are left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch

from ..errors import UserError
from ..rewards.stage import RewardUnavailable
from .checkpoint import checkpoint_dir, latest_checkpoint
from .disk import DiskFull, as_disk_full, is_disk_full
from .oom import oom_stage, out_of_memory
from .recovery import SNAPSHOT_MAX_PARAMS, RankStopped, RunStopped, StopRequested
from .run_dir import resume_command

PEER_WAIT = 5.0  # seconds a rank whose collective failed waits to learn which peer exited


class Stopping:
    def _watch_peers(self) -> None:
        if self.engine.world_size > 1:
            from ..distributed.peers import PeerWatch

            self.peers = PeerWatch(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def _hint(self, failure: bool = False) -> str:
        """The message's last line: how the run continues. A rank that fails under `torchrun --max-restarts N`
        with restarts left is restarted by torchrun (a signal to torchrun itself is not)."""
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if failure and self.peers is not None and restarts > done:
            return f"\ntorchrun restarts the run from there (restart {done + 1} of {restarts})"
        return f"\nresume with: {resume_command(self.overrides, self.run_dir, self.launcher)}"

    def _as_disk_full(self, error: BaseException) -> DiskFull:
        """A full disk stops the run with one line; nothing more is written (not even the metrics log)."""
        self._disk_full = True
        if self.logger is not None:
            self.logger.disk_full = True
        return as_disk_full(error, self.run_dir, latest_checkpoint(self.run_dir),
                            resume_command(self.overrides, self.run_dir, self.launcher))

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: one small sum over ranks per step, so that every rank stops after
        the same step (a signal may reach one rank only, or reach them at different points of a step)."""
        if self.engine.world_size == 1:
            return self._stop is not None
        asked = self.engine.sum(torch.tensor([0 if self._stop is None else self._stop], device=self.engine.device))
        if int(asked) and self._stop is None:
            self._stop = int(signal.SIGTERM)  # another rank's signal
        return bool(int(asked))

    @contextmanager
    def _signal_handlers(self):
        """`_on_signal` while the run trains. A rank of a multi-rank run that stopped keeps it (it then ignores
        signals) until `close`: torchrun signals every rank once one exits, and the default action would end this
        one before its message is printed."""
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            if self.engine.world_size > 1 and self._recovering:
                self._held_signals = previous
            else:
                _restore(previous)

    def _release_signals(self) -> None:
        _restore(getattr(self, "_held_signals", {}))
        self._held_signals = {}

    def _on_signal(self, signum: int, frame) -> None:
        """First signal: abandon what can be redone (a rollout before any weight changed, one process; an
        evaluation not spread over ranks), else finish the step's update and stop after it. A second signal stops
        at once (an update in progress is rolled back from its snapshot). After a peer exited (torchrun then
        signals the survivors) the step cannot complete: it is abandoned at once, a checkpoint write finished."""
        first = self._stop is None
        self._stop = self._stop or signum
        if self._recovering:  # saving already
            return
        if self.peers is not None and self.peers.exits(wait=0.2):
            if self._phase in ("step", "update", "eval") and sys.exc_info()[1] is None:  # else a failure is handled
                raise StopRequested(signum)
            return
        alone = self.engine.world_size == 1
        if not first or (self._phase == "eval" and (alone or not self.engine.sharded)) or (
                self._phase == "step" and alone):
            # an abandoned evaluation is caught in `_eval_and_grid`; the stop then happens at the step's end
            raise StopRequested(signum)
        self.say(f"\npolyrl: {signal.Signals(signum).name}: stopping after this step (send it again to stop at once)")

    def _recover(self, collective: bool) -> str:
        """After a stop or a failure: undo the unfinished step (its prompts are drawn again on resume; an update in
        progress is rolled back), log a completed step whose log line was not written, and save the last completed
        step (with its evaluation due, when that was cut short). Returns what was done, for the message."""
        phase, self._phase = self._phase, "idle"
        self._recovering = True
        if self._pending is not None and self._eval_due is None and self.logger is not None:
            try:
                self.logger.log(self._pending)
            except DiskFull as e:
                raise self._as_disk_full(e) from e
            self._pending = None
        if phase in ("step", "update"):
            self.data.source.load_state_dict(self._source_before)
            if phase == "update":
                if self._snapshot is None:
                    last = checkpoint_dir(self.run_dir, self.saved_step) if self.saved_step else None
                    return (f"the weights were in the middle of an update and too large to keep a copy of (over "
                            f"{SNAPSHOT_MAX_PARAMS} trainable elements), so step {self.step} could not be saved; the "
                            f"last checkpoint is {last or 'none'}")
                self._snapshot.restore(self.actor)
        if self.step == 0:
            return "no training step had completed: nothing to save"
        alone = self.engine.world_size > 1 and not collective
        # rank 0 writes; it knows whether its checkpoint is complete, and sharded weights need every rank to save
        if alone and (not self.engine.is_main or (self.engine.sharded and self.saved_step != self.step)):
            last = latest_checkpoint(self.run_dir)
            return f"the last complete checkpoint is {last}" if last else "no checkpoint has been written yet"
        try:
            ckpt = self._save(collective)
        except DiskFull as e:  # the last complete checkpoint stays the resume point: one line says so
            raise self._as_disk_full(e) from e
        except UserError as e:  # CheckpointError
            return f"step {self.step} could not be saved: {e}"
        due = "; its evaluation runs again on resume" if self._eval_due is not None else ""
        return f"saved checkpoint {ckpt} (step {self.step}{due})"

    def _failed(self, error: BaseException) -> BaseException:
        """The exception to raise for a failure that stopped the run, after saving the last completed step: a
        reward service that gave up, or a non-finite gradient, is re-raised with the save note (the CLI prints it
        as one line); anything else keeps its type and traceback, the note printed first. A full disk is DiskFull,
        one line, with nothing more written: no second checkpoint on the full disk, the step that was in progress
        is redone after resuming from the last complete checkpoint. An out-of-memory is one line too
        (trainer/oom.py). A collective that failed because another rank stopped is that rank's stop
        (`_peer_stopped`); on a rank other than 0, a failure of its own is left for rank 0 to report (`_told`)."""
        self._recovering = True
        if is_disk_full(error):
            full = self._as_disk_full(error)
            return self._told(full, f"error: {full}", 2, complete=True)
        oom = oom_stage(error, self._phase)  # before _recover: it frees the failed stage's tensors
        stopped = isinstance(error, (RewardUnavailable, FloatingPointError))
        if self.peers is not None and not (oom or stopped or isinstance(error, UserError)):
            # a broken collective (a RuntimeError) shows a little after the peer stopped
            gone = self.peers.exits(wait=PEER_WAIT if isinstance(error, RuntimeError) else 0.5)
            if gone:
                return self._peer_stopped(gone)
        code = 3 if stopped else 2 if oom or isinstance(error, UserError) else 1
        if self.peers is not None and not self.engine.is_main:  # rank 0 saves and says it
            return self._told(out_of_memory(error, oom, self.cfg) if oom else error, _one_line(error), code)
        note = self._recover(collective=False)
        hint = self._hint(failure=True) if self.step > 0 else ""
        if oom:
            out = out_of_memory(error, oom, self.cfg, note + hint)
            return self._told(out, f"error: {out}", code)
        if stopped:
            out = type(error)(f"{error}\n{note}{hint}")
            return self._told(out, f"stopped: {out}", code)
        if isinstance(error, Exception):
            self.say(f"polyrl: the run failed in step {self.step + 1} ({type(error).__name__}); {note}{hint}")
        return self._told(error, _one_line(error), code)

    def _told(self, error: BaseException, text: str, code: int, complete: bool = False) -> BaseException:
        """Leave this rank's reason in the store (a multi-rank run); rank 0 prints it (raises `error`), another rank
        exits without a word (RankStopped) unless `error` is a bug, which keeps its traceback."""
        if self.peers is None:
            return error
        main = self.engine.is_main
        self.peers.publish(text, code, reported=main, complete=complete)
        if main or not isinstance(error, (UserError, RewardUnavailable, FloatingPointError)):
            return error
        return RankStopped(code)

    def _peer_stopped(self, gone: list) -> BaseException:
        """This rank stops because other ranks exited (`gone`: PeerExit, lowest rank first). When one of them
        printed why, nothing more is said; else the lowest surviving rank says which rank exited and how (or the
        reason it left), after rank 0 saved the last completed step (not after a full disk)."""
        t = self.cfg.trainer
        if any(e.record and e.record["reported"] for e in gone):
            return RankStopped(next(e.record["code"] for e in gone if e.record and e.record["reported"]))
        dead = {e.rank for e in gone}
        reporter = min(r for r in range(self.engine.world_size) if r not in dead)
        said = next((e for e in gone if e.record), None)  # a rank that left a reason it did not print
        if said is not None and said.record.get("complete"):  # a full disk: nothing more is written
            return RunStopped(said.record["text"], exit_code=said.record["code"], report=self.engine.rank == reporter)
        note = self._recover(collective=False)
        hint = self._hint(failure=True) if self.step > 0 else ""
        first = said or gone[0]
        if said is not None:
            message, code = f"stopped: rank {said.rank} (pid {said.pid}): {said.record['text']}\n{note}{hint}", \
                said.record["code"]
        else:
            how = f"exited ({first.status})" if first.status else "exited"
            message, code = f"stopped: rank {first.rank} (pid {first.pid}) {how} at step {self.step} of " \
                            f"{t.max_steps}; {note}{hint}", 3
        return RunStopped(message, exit_code=code, report=self.engine.rank == reporter)


def _restore(handlers: dict) -> None:
    for s, handler in handlers.items():
        signal.signal(s, handler)


def _one_line(error: BaseException) -> str:
    """An error's first line; a bug's with its type (its traceback is in that rank's output)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(error, (UserError, RewardUnavailable, FloatingPointError)):
        return first
    return f"{type(error).__name__}: {first} (its traceback is in that rank's output)"
