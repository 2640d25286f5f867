"""`polyrl view [DIR ...] [--port N] [--host H]`: a local web page over run directories (polyrl/view/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError


def parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="polyrl view", description=(
        "A read-only web page over run directories: runs and their state, curves (several runs overlaid, seeds as a "
        "band), held-out samples by step, polyrl eval reports. It reads the directories' files and writes nothing."))
    p.add_argument("dirs", nargs="*", metavar="DIR",
                   help="directories holding runs, searched below (default: runs/ when it exists, else .)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 shares the runs' files)")
    ns = p.parse_args(args)
    if not 0 <= ns.port <= 65535:
        raise UserError(f"polyrl view: --port {ns.port} is not a port (0-65535)")
    return ns


def main(args: list[str]) -> int:
    from ..view.server import serve

    ns = parse(args)
    dirs = [Path(d) for d in ns.dirs] or [Path("runs") if Path("runs").is_dir() else Path(".")]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise UserError(f"polyrl view: {missing[0]}: no such directory")
    try:
        return serve(dirs, ns.host, ns.port)
    except OSError as e:  # the port is taken, the address is not this machine's
        raise UserError(f"polyrl view: cannot listen on {ns.host}:{ns.port} ({e.strerror or e})") from None
