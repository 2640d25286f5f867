"""How the ranks of a multi-process run learn that one of them stopped, and why.

At the start every rank tells the others its pid and host (one `all_gather_object`). Each rank then starts a small
watcher process (distributed/peer_watcher.py) that holds pidfds of the peers on its host (Linux >= 5.3): the moment
one exits, it reads the peer's exit status from `/proc/<pid>/stat` (field 52, `exit_code`, in waitpid's form) while
the peer is a zombie, before its parent (torchrun's agent, polling every `--monitor-interval`, 0.1 s by default)
reaps it, and tells the rank. A process of its own, so that a rank busy holding the GIL (or a CPU shared by many
jobs) does not make it late; a status read too late anyway is unknown (""). A rank that stops on an error of its
own (a reward outage, a full disk, a bug) first leaves one record in the process group's store (`publish`): what it
said, its exit code, whether it printed it itself; a survivor reads it (`exits`) and so does not report a stop
twice, or reports a rank's reason that rank did not print.

Peers on other hosts are not watched (their pids mean nothing here); their stop shows as a failed collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from .peer_watcher import exit_status


@dataclass
class PeerExit:
    """A peer that exited: `status` is "signal 9" / "exit code 3" / "" (not known), `record` what it published
    before stopping (None: nothing, e.g. killed)."""

    rank: int
    pid: int
    status: str
    record: dict | None = None


class PeerWatch:
    """The other ranks of this run: their pids and hosts, the ones that exited (`exits`), and the store records
    (`publish`). Start it on every rank after the process group (a collective)."""

    def __init__(self, key: str = ""):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, (os.getpid(), self.host))
        self.pids = [pid for pid, _ in everyone]
        self.hosts = [host for _, host in everyone]
        self.key = f"polyrl_stop/{key}"  # per torchrun restart: an earlier attempt's records are not this one's
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # a private torch function: without it, no records (the rest still works)
            self.store = None
        self._lock = threading.Lock()
        self._exits: dict[int, PeerExit] = {}
        self._seen = threading.Event()
        self._local = [r for r in range(self.world_size) if r != self.rank and self.hosts[r] == self.host]
        self._unwatched: set[int] = set()  # local peers without a watcher: checked when asked (`exits`)
        self._watcher = None
        if self._local:
            self._watcher = subprocess.Popen(
                [sys.executable, "-S", str(Path(__file__).with_name("peer_watcher.py")),
                 *(f"{r}:{self.pids[r]}" for r in self._local)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                text=True)
            threading.Thread(target=self._listen, name="polyrl-peer-watch", daemon=True).start()

    def _listen(self) -> None:
        """The watcher's lines: `RANK STATUS` per exited peer."""
        for line in self._watcher.stdout:
            rank, _, status = line.strip().partition(" ")
            if rank.isdigit():
                self._add(int(rank), "" if status == "unknown" else status)
        with self._lock:  # the watcher ended (unsupported, or killed): whoever is left is checked when asked
            self._unwatched.update(r for r in self._local if r not in self._exits)

    def _add(self, rank: int, status: str) -> None:
        with self._lock:
            self._exits.setdefault(rank, PeerExit(rank, self.pids[rank], status))
        self._seen.set()

    def exits(self, wait: float = 0.0) -> list[PeerExit]:
        """The peers known to have stopped, lowest rank first: exited (`status`), or still tearing down after
        leaving a record (`status` ""), each with its store record. `wait`: seconds to wait for a first one (a
        collective fails a few milliseconds after a peer exits or closes its process group)."""
        deadline = time.monotonic() + wait
        while True:
            for rank in list(self._unwatched):
                if not _alive(self.pids[rank]):
                    self._unwatched.discard(rank)
                    self._add(rank, exit_status(self.pids[rank]))
            with self._lock:
                found = dict(self._exits)
            for rank in range(self.world_size):
                if rank != self.rank and (rank not in found or found[rank].record is None):
                    record = self.record(rank)
                    if record is not None:
                        found.setdefault(rank, PeerExit(rank, self.pids[rank], "")).record = record
            if found or time.monotonic() >= deadline:
                return sorted(found.values(), key=lambda e: e.rank)
            self._seen.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def publish(self, text: str, code: int, reported: bool, complete: bool = False) -> None:
        """Leave this rank's reason for stopping in the store (one JSON record): `text` what it says, `code` its
        exit code, `reported` whether this rank printed it, `complete`: `text` is the whole message to print
        (`polyrl: <text>`; a full disk, after which nothing is saved), else a survivor says it after saving."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.key}/{self.rank}",
                           json.dumps({"text": text, "code": code, "reported": reported, "complete": complete}))
        except Exception:  # the store is gone too: the survivors then say only how this rank exited
            pass

    def record(self, rank: int) -> dict | None:
        if self.store is None:
            return None
        try:
            key = f"{self.key}/{rank}"
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None

    def close(self) -> None:
        if self._watcher is not None and self._watcher.poll() is None:
            self._watcher.kill()
            self._watcher.wait()


def _alive(pid: int) -> bool:
    """Whether a process of this host is running (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: it exists
        return True
    return exit_status(pid) == ""
