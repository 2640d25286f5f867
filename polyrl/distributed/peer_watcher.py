"""The watcher process of a rank (distributed/peers.py): `python -S peer_watcher.py RANK:PID ...` prints
`RANK STATUS` the moment each of those processes exits, STATUS being `signal N`, `exit_code N` or `unknown`, and ends
with its parent. Standard library only, no GIL shared with the rank: it reads a dead peer's exit status from
`/proc/<pid>/stat` while the peer is a zombie, before torchrun (polling every --monitor-interval, 0.1 s by default)
reaps it, however busy the rank is. Prints `unsupported` and ends where pidfds are missing (not Linux >= 5.3)."""

from __future__ import annotations

import os
import select
import signal
import sys


def exit_status(pid: int) -> str:
    """"signal N" / "exit code N" of a zombie process (any process of this user whose parent has not reaped it yet),
    "" when it cannot be read (reaped, not a zombie, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return ""
    if len(fields) < 50 or fields[0] not in ("Z", "X"):
        return ""
    status = int(fields[49])  # field 52 of proc(5); fields[0] is field 3
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else ""


def main(args: list[str]) -> None:
    for s in (signal.SIGTERM, signal.SIGINT):  # torchrun signals the rank's process group: the rank decides
        signal.signal(s, signal.SIG_IGN)
    try:
        parent = os.pidfd_open(os.getppid())
        peers = {}
        for arg in args:
            rank, pid = (int(x) for x in arg.split(":"))
            try:
                peers[os.pidfd_open(pid)] = (rank, pid)
            except ProcessLookupError:
                print(f"{rank} unknown", flush=True)
    except (AttributeError, OSError):
        print("unsupported", flush=True)
        return
    poller = select.poll()
    for fd in [parent, *peers]:
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == parent:
                return
            rank, pid = peers.pop(fd)
            print(f"{rank} {exit_status(pid) or 'unknown'}", flush=True)
            poller.unregister(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
