"""Soak: the toy recipe trained deterministically, in rounds, for a given time while faults are injected at random
steps; each round must end with every step once in metrics.jsonl and the final LoRA weights (and every logged
number but times) equal to an uninterrupted deterministic run's of the same length (docs/checkpoints.md).

    nice -n 19 python scripts/soak.py --minutes 30                 # rounds of 16 steps, faults at random steps
    python scripts/soak.py --minutes 5 --steps 8 --seed 1 --workdir /tmp/soak
    nice -n 19 python scripts/soak.py --minutes 30 --nproc 2 --backend fsdp2     # two ranks under torchrun

With --nproc 2 every run (the reference too) is `torchrun --standalone --nproc-per-node=2 -m polyrl train ...` on
gloo, each rank's output in its own file (torchrun's --log-dir / --redirects), and `--backend fsdp2` shards the
weights over the two ranks (`actor.backend=fsdp2 parallel.dp_shard=2`).

Faults (each round draws 2-4 of them, every kind equally often, at distinct random steps):
    reward_blip    the reward server (reward=http, `polyrl serve-reward reward=shapes`) killed -9 and restarted
                   at once: the trainer's retries must absorb it (no exit)
    reward_outage  the reward server killed and left down: the run saves its last step and exits 3
                   (`polyrl: stopped:`); the server is restarted and the run resumed
    sigterm        SIGTERM: the run saves and exits 143; resumed
    kill9_save     kill -9 in the middle of a checkpoint write (after the weights / half of trainer_state.pt /
                   before the rename / in the middle of a rotation: scripts/soak_faults.py); resumed
    disk_full      the run directory's disk filled (a tmpfs mounted for the soak, filled up to 0 B or a random 4 KiB
                   to 2 MiB from full: less than a checkpoint); expected: one `polyrl: error: disk full: ...` line,
                   no traceback, exit 2; the disk is freed and the run resumed. Without root (no tmpfs) the
                   checkpoint writer fails with ENOSPC instead.
    eval_outage    the reward server killed -9 as a held-out evaluation starts (scripts/soak_faults.py, inside the
                   run): the trained step is saved with its evaluation due, exit 3; resumed, the step is evaluated
    eval_sigterm   SIGTERM (to the launcher) as an evaluation starts: the step is saved with its evaluation due
                   (sharded ranks finish the evaluation first), exit 143; resumed
    eval_kill9     kill -9 of the (rank 0) process as an evaluation starts; resumed from the last checkpoint
    eval_disk_full the disk filled (to 0 B) as an evaluation writes its samples: one `polyrl: error: disk full:
                   could not write the samples of step N ...` line, exit 2; freed, resumed
    rank_kill      (--nproc 2) kill -9 of a random rank: the surviving rank prints one line, `polyrl: stopped:
                   rank R (pid P) exited (signal 9) at step k of N; ...`, no traceback; resumed
With --nproc 2, `sigterm` goes to torchrun (which signals both ranks), and each fault's line must be printed once,
by one rank. Every run resumes with trainer.resume=auto. The summary (faults, exits, checks) is printed and written as JSON to
<workdir>/soak.json; the exit code is 0 only when every round passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
FAULT_MODULE = REPO / "scripts" / "soak_faults.py"
FAULTS = ("reward_blip", "reward_outage", "sigterm", "kill9_save", "disk_full", "eval_outage", "eval_sigterm",
          "eval_kill9", "eval_disk_full", "rank_kill")
IN_PROCESS = ("kill9_save", "eval_outage", "eval_sigterm", "eval_kill9", "eval_disk_full")  # armed by soak_faults
KILL_POINTS = ("kill_weights", "kill_state", "kill_fsync", "kill_rotate")
KEEP = 2  # trainer.keep_checkpoints of the soak's runs (with keep_best)


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def polyrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "polyrl", *args]


class Launch:
    """How the soak starts a training run: one process, or torchrun with `nproc` ranks whose outputs go to files
    under a log directory (`output` reads them back, rank by rank)."""

    def __init__(self, nproc: int, backend: str):
        self.nproc, self.backend = nproc, backend

    def command(self, args: list[str], logs: Path) -> list[str]:
        if self.nproc == 1:
            return polyrl(*args)
        layout = ["actor.backend=fsdp2", f"parallel.dp_shard={self.nproc}"] if self.backend == "fsdp2" else []
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                f"--log-dir={logs}", "--redirects=3", "-m", "polyrl", *args, *layout]

    def output(self, log: Path) -> str:
        """What the ranks wrote to stderr (one process: its stderr file; torchrun: each rank's file, in order)."""
        if self.nproc == 1:
            return log.read_text(errors="replace") if log.is_file() else ""
        files = sorted(log.with_suffix("").glob("*/attempt_*/*/stderr.log"), key=lambda p: int(p.parent.name))
        return "".join(f.read_text(errors="replace") for f in files)

    def rank_pids(self, proc: subprocess.Popen) -> dict[int, int]:
        """rank -> pid of torchrun's workers (its children, read from /proc)."""
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                    continue
                env = dict(v.split("=", 1) for v in (stat.parent / "environ").read_bytes().decode().split("\0")
                           if "=" in v)
                out[int(env["RANK"])] = int(stat.parent.name)
            except (OSError, ValueError, KeyError, IndexError):
                continue
        return out


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    env.pop("POLYRL_SOAK_FAULT", None)
    return {**env, **(extra or {})}


class RewardServer:
    """`polyrl serve-reward reward=shapes` on a fixed port, killed and restarted by the faults."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None
        self.pidfile = log.with_suffix(".pid")

    def start(self, timeout: float = 180.0) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(polyrl("serve-reward", "reward=shapes", "--port", str(self.port)),
                                         env=child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.pidfile.write_text(str(self.proc.pid))  # eval_outage kills the server running then (soak_faults.py)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the reward server exited ({self.proc.returncode}); see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).close()
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"the reward server did not answer /health in {timeout:.0f} s; see {self.log}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Disk:
    """The rounds' run directories: a tmpfs of `mb` MiB (root), else a plain directory (disk_full is then the
    patched writer's ENOSPC)."""

    def __init__(self, root: Path, mb: int):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.tmpfs = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(root)], capture_output=True).returncode == 0
        self.filler = root / "filler"

    def fill(self, leave: int) -> int:
        """Fill the disk until `leave` bytes are free; returns the bytes written."""
        free = shutil.disk_usage(self.root).free
        size = max(free - leave, 0)
        with open(self.filler, "ab") as f:
            chunk = b"\0" * 2**20
            written = 0
            try:
                while written < size:
                    written += f.write(chunk[: min(len(chunk), size - written)])
                f.flush()
            except OSError:
                pass
        return written

    def free_up(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", str(self.root)], check=False)


def train_args(run_dir: Path, steps: int, port: int) -> list[str]:
    """The soak's toy run: the toy Flow-GRPO recipe (the default's algorithm when docs/checkpoints.md's soak was
    measured), shrunk so a step takes about a second on two cores."""
    return ["train", "recipe=toy_flow_grpo", f"trainer.output_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.resume=auto",
            "trainer.deterministic=true", "trainer.progress=false", "trainer.seed=0",
            "data.prompts_per_step=2", "rollout.n=4", "rollout.batch_size=8", "rollout.height=32", "rollout.width=32",
            "rollout.num_steps=6", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,3]",
            "trainer.save_every=2", "trainer.eval_every=2", "trainer.eval_samples=4", "trainer.num_validation=4",
            f"trainer.keep_checkpoints={KEEP}", "trainer.keep_best=true",
            "reward=http", f"reward.url=http://127.0.0.1:{port}", "reward.max_retries=6", "reward.backoff=1.0",
            "reward.max_backoff=8.0", "reward.connect_timeout=2.0"]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return -1
    step = -1
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = max(step, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            pass
    return step


def comparable(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def final_weights(run_dir: Path, steps: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{steps:06d}" / "adapter_model.safetensors"))


def attempt(launch: Launch, args: list[str], run_dir: Path, log: Path, faults: list[dict], server: RewardServer,
            disk: Disk, extra_env: dict) -> tuple[int, str, dict | None]:
    """One `polyrl train` launch (a process, or torchrun and its ranks). `faults`: the round's pending faults, in
    step order; the reward blips before the first other fault are injected in this launch once it has trained a
    step and reached theirs (each marked absorbed when the run goes on), then that other fault, which should end
    it (an external one injected here, an in-process one armed through `extra_env`). Returns (exit code, what the
    ranks wrote to stderr, the fault injected that should have ended the launch, or None)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(launch.command(args, log.with_suffix("")), env=child_env(extra_env),
                                stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
    ending = next((f for f in faults if f["kind"] != "reward_blip"), None)
    blips = [f for f in faults if f["kind"] == "reward_blip" and (ending is None or f["step"] < ending["step"])]
    armed = ending is not None and ending["kind"] in IN_PROCESS or (
        ending is not None and ending["kind"] == "disk_full" and not disk.tmpfs)
    injected, baseline = None, None
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if baseline is None:  # faults wait for this launch to train a step (signal handlers installed)
                if "polyrl: run directory" in launch.output(log):
                    baseline = last_step(run_dir)  # after the resume's truncation of metrics.jsonl
                continue
            step = last_step(run_dir)
            if step <= baseline:
                continue
            if blips and step >= blips[0]["step"]:
                blip = blips.pop(0)
                server.kill()
                server.start()
                blip["note"] = f"server killed -9 and restarted at step {step}"
                blip["injected"] = True
                continue
            if ending is None or armed or injected is not None or blips or step < ending["step"]:
                continue
            kind, injected = ending["kind"], ending
            if kind == "reward_outage":
                server.kill()
                ending["note"] = f"server killed at step {step}"
            elif kind == "sigterm":  # to torchrun with --nproc 2
                proc.send_signal(signal.SIGTERM)
            elif kind == "rank_kill":
                pid = launch.rank_pids(proc).get(ending["rank"])
                if pid is None:
                    injected = None  # not running (yet): tried again at the next poll
                    continue
                ending["pid"] = pid
                os.kill(pid, signal.SIGKILL)
                ending["note"] = f"rank {ending['rank']} (pid {pid}) killed -9 at step {step}"
            elif kind == "disk_full":
                ending["note"] = f"filled {disk.fill(ending['leave'])} bytes at step {step}, {ending['leave']} left free"
        if armed and proc.returncode != 0:
            injected = ending
        return proc.returncode, launch.output(log), injected
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def expected(kind: str, code: int, err: str, fault: dict, launch: Launch) -> tuple[bool, str]:
    """Whether a launch that a fault of `kind` ended ended as it should, and why not. One process: its exit code
    and lines. Several ranks: torchrun exits non-zero, and the fault's line is printed once, by one rank."""
    errors = [line for line in err.splitlines() if line.startswith("polyrl: error:")]
    stops = [line for line in err.splitlines() if line.startswith(("polyrl: stopped", "polyrl: error"))]
    if "Traceback" in err:
        return False, "a traceback"
    if kind.startswith("eval_") and f"soak_faults: {kind}" not in err and "the disk fills as the samples" not in err:
        return False, "the fault did not fire in an evaluation"
    redone = "its evaluation runs again on resume"
    if launch.nproc == 1:
        if kind in ("reward_outage", "eval_outage"):
            return code == 3 and "polyrl: stopped:" in err and (kind == "reward_outage" or redone in err), f"exit {code}"
        if kind in ("sigterm", "eval_sigterm"):
            return (code == 128 + signal.SIGTERM and "stopped by SIGTERM" in err
                    and (kind == "sigterm" or redone in err)), f"exit {code}"
        if kind in ("kill9_save", "eval_kill9"):
            return code == -signal.SIGKILL and "soak_faults: SIGKILL" in err, f"exit {code}"
        if kind in ("disk_full", "eval_disk_full"):
            ok = code == 2 and len(errors) == 1 and errors[0].startswith("polyrl: error: disk full:")
            return ok and (kind == "disk_full" or "samples of step" in errors[0]), f"exit {code}, error lines {errors}"
        return False, f"exit {code} (the run should not have stopped)"
    why = f"torchrun exit {code}, lines {stops}"
    if code == 0 or len(stops) != 1:
        return False, why
    line = stops[0]
    if kind in ("reward_outage", "eval_outage"):
        return line.startswith("polyrl: stopped: "), why
    if kind in ("sigterm", "eval_sigterm"):
        return "stopped by SIGTERM" in line, why
    if kind in ("kill9_save", "eval_kill9"):
        return "soak_faults: SIGKILL" in err and re.match(r"polyrl: stopped: rank 0 \(pid \d+\) exited \(signal 9\) "
                                                         r"at step \d+ of \d+; ", line) is not None, why
    if kind == "rank_kill":
        return line.startswith(f"polyrl: stopped: rank {fault['rank']} (pid {fault.get('pid')}) exited (signal 9) "
                               "at step "), why
    if kind in ("disk_full", "eval_disk_full"):
        return line.startswith("polyrl: error: disk full:") and (kind == "disk_full" or "samples of step" in line), why
    return False, why


_BAG: list[str] = []


def draw_kind(rng: random.Random, kinds: tuple[str, ...]) -> str:
    """The next fault kind: every kind once, in a shuffled order, then again (each kind equally often)."""
    if not _BAG:
        _BAG.extend(rng.sample(kinds, len(kinds)))
    return _BAG.pop()


def run_round(i: int, rng: random.Random, steps: int, work: Path, disk: Disk, server: RewardServer,
              reference: Path, kinds: tuple[str, ...], launch: Launch) -> dict:
    run_dir = disk.root / f"round_{i:03d}"
    logs = work / "logs" / f"round_{i:03d}"
    logs.mkdir(parents=True, exist_ok=True)
    at = sorted(rng.sample(range(1, steps - 1), rng.randint(2, min(4, steps - 2))))
    faults = [{"kind": draw_kind(rng, kinds), "step": s} for s in at]
    for f in faults:
        if f["kind"] == "kill9_save":
            f["point"] = rng.choice(KILL_POINTS)
        if f["kind"] == "disk_full":  # 0 B: the next write of any size fails; else less than a checkpoint (2.3 MiB)
            f["leave"] = rng.choice([0, rng.randrange(4096, 2 * 2**20)])
        if f["kind"] == "eval_disk_full":  # full as the samples are written
            f["leave"] = 0
        if f["kind"] == "rank_kill":
            f["rank"] = rng.randrange(launch.nproc)
    say(f"round {i}: {steps} steps, faults " + ", ".join(f"{f['kind']}@{f['step']}" for f in faults))
    pending, processes, outcome = list(faults), 0, {"round": i, "faults": faults, "problems": []}
    t0 = time.monotonic()
    while True:
        ending = next((f for f in pending if f["kind"] != "reward_blip"), None)
        env = {}
        if ending is not None and ending["kind"] == "kill9_save":
            env["POLYRL_SOAK_FAULT"] = f"{ending['point']}:{ending['step']}"
        if ending is not None and ending["kind"] == "disk_full" and not disk.tmpfs:
            env["POLYRL_SOAK_FAULT"] = f"enospc:{ending['step']}"
        if ending is not None and ending["kind"].startswith("eval_"):
            env["POLYRL_SOAK_FAULT"] = f"{ending['kind']}:{ending['step']}"
            env["POLYRL_SOAK_SERVER_PIDFILE"] = str(server.pidfile)
            if ending["kind"] == "eval_disk_full" and disk.tmpfs:
                env["POLYRL_SOAK_FILL"] = f"{disk.filler}:{ending['leave']}"
        args = train_args(run_dir, steps, server.port) + (["--import", str(FAULT_MODULE)] if env else [])
        processes += 1
        code, err, fault = attempt(launch, args, run_dir, logs / f"process_{processes:02d}.err", pending, server,
                                   disk, env)
        disk.free_up()  # after any exit: the disk freed, the reward server up again
        if server.proc is None or server.proc.poll() is not None:
            server.start()
        for blip in [f for f in pending if f.get("injected")]:  # the run had to go on past each blip
            went_on = code == 0 or last_step(run_dir) > blip["step"] or (fault is not None and fault is not blip)
            blip["result"] = "absorbed" if went_on else f"exit {code}"
            if not went_on:
                outcome["problems"].append(f"reward_blip@{blip['step']}: the run exited {code}; see {logs}")
            pending.remove(blip)
        if code == 0:
            for f in pending:
                f["result"] = ("injected; the run finished in the space left" if "note" in f
                               else "not reached (the run ended first)")
            break
        if fault is None:
            outcome["problems"].append(f"process {processes} exited {code} with no fault injected; see {logs}")
            if processes > 3 * len(faults) + 3:
                break
            continue
        ok, why = expected(fault["kind"], code, err, fault, launch)
        fault["result"] = f"exit {code}" + ("" if ok else f" UNEXPECTED ({why})")
        fault["stopped_at"] = last_step(run_dir)
        lines = [line for line in err.splitlines() if line.startswith(("polyrl: error:", "polyrl: stopped:"))]
        if lines:
            fault["message"] = lines[-1]
        if not ok:
            outcome["problems"].append(f"{fault['kind']}@{fault['step']}: {why}; see {logs}")
        pending.remove(fault)
    outcome["processes"], outcome["seconds"] = processes, round(time.monotonic() - t0, 1)
    # the checks
    rows = comparable(run_dir)
    seen = [r["step"] for r in rows]
    dupes = sorted({s for s in seen if seen.count(s) > 1})
    missing = sorted(set(range(steps + 1)) - set(seen))
    if dupes or missing:
        outcome["problems"].append(f"metrics.jsonl: steps logged twice {dupes}, missing {missing}")
    if rows != comparable(reference):
        differ = [a["step"] for a, b in zip(rows, comparable(reference), strict=False) if a != b]
        outcome["problems"].append(f"metrics differ from the uninterrupted run's at steps {differ[:10]}")
    try:
        a, b = final_weights(run_dir, steps), final_weights(reference, steps)
        import torch

        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            outcome["problems"].append("the final LoRA weights differ from the uninterrupted run's")
    except Exception as e:
        outcome["problems"].append(f"final weights unreadable: {type(e).__name__}: {e}")
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    outcome["checkpoints_left"] = kept
    if len(kept) > KEEP + 1 or any(not n.startswith("step_") or "." in n for n in kept):
        outcome["problems"].append(f"checkpoints left: {kept} (keep_checkpoints={KEEP}, keep_best=true)")
    outcome["passed"] = not outcome["problems"]
    say(f"round {i}: {'PASSED' if outcome['passed'] else 'FAILED'} in {outcome['seconds']} s, {processes} processes; "
        + "; ".join(f"{f['kind']}@{f['step']}: {f.get('result', '?')}" for f in faults)
        + ("" if outcome["passed"] else f"; problems: {outcome['problems']}"))
    shutil.rmtree(run_dir, ignore_errors=True)
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0,
                   help="start rounds until this much time has passed (the reference run included; one round at least)")
    p.add_argument("--steps", type=int, default=16, help="training steps per round")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (training's seed is fixed)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/polyrl_soak"))
    p.add_argument("--tmpfs-mb", type=int, default=64)
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (> 1: torchrun on gloo)")
    p.add_argument("--backend", choices=("local", "fsdp2"), default="local", help="actor.backend with --nproc > 1")
    p.add_argument("--faults", default=None, help="the kinds to draw from, comma-separated (default: all; "
                                                  "rank_kill only with --nproc > 1)")
    a = p.parse_args()
    launch = Launch(a.nproc, a.backend)
    kinds = tuple(k for k in (a.faults or ",".join(FAULTS)).split(",") if k and (a.faults or k != "rank_kill"
                                                                                   or a.nproc > 1))
    if not kinds or set(kinds) - set(FAULTS) or ("rank_kill" in kinds and a.nproc < 2):
        p.error(f"--faults: give some of {', '.join(FAULTS)} (rank_kill with --nproc > 1)")
    if a.backend == "fsdp2" and a.nproc < 2:
        p.error("--backend fsdp2 needs --nproc 2 or more")
    if a.steps < 4:
        p.error("--steps must be >= 4")
    shutil.rmtree(a.workdir, ignore_errors=True)
    a.workdir.mkdir(parents=True)
    rng = random.Random(a.seed)
    deadline = time.monotonic() + a.minutes * 60
    server = RewardServer(free_port(), a.workdir / "reward_server.log")
    disk = Disk(a.workdir / "disk", a.tmpfs_mb)
    summary = {"steps": a.steps, "seed": a.seed, "minutes": a.minutes, "nproc": a.nproc, "backend": a.backend,
               "tmpfs": disk.tmpfs, "faults": kinds, "load_start": os.getloadavg(), "rounds": []}
    t0 = time.monotonic()
    try:
        server.start()
        say(f"reward server on port {server.port}; run directories on "
            + (f"a {a.tmpfs_mb} MiB tmpfs" if disk.tmpfs else "the plain disk (no tmpfs: ENOSPC is patched in)"))
        reference = a.workdir / "reference"
        code = subprocess.run(launch.command(train_args(reference, a.steps, server.port), a.workdir / "reference_logs"),
                              env=child_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=open(a.workdir / "reference.err", "w")).returncode
        if code != 0:
            say(f"the uninterrupted reference run failed ({code}); see {a.workdir / 'reference.err'}")
            return 1
        summary["reference_seconds"] = round(time.monotonic() - t0, 1)
        say(f"reference run of {a.steps} steps: {summary['reference_seconds']} s")
        i = 0
        while i == 0 or time.monotonic() < deadline:  # at least one round
            summary["rounds"].append(run_round(i, rng, a.steps, a.workdir, disk, server, reference, kinds, launch))
            summary["rounds"][-1]["load"] = os.getloadavg()  # 1, 5, 15 minutes (the machine may be shared)
            i += 1
            (a.workdir / "soak.json").write_text(json.dumps(summary, indent=1))
    finally:
        server.kill()
        disk.close()
    rounds = summary["rounds"]
    faults = [f for r in rounds for f in r["faults"]]
    counts = {k: sum(f["kind"] == k and ("note" in f or "exit" in f.get("result", "")) for f in faults) for k in kinds}
    summary["faults_injected"] = counts
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["passed"] = bool(rounds) and all(r["passed"] for r in rounds)
    (a.workdir / "soak.json").write_text(json.dumps(summary, indent=1))
    loads = [summary["load_start"][0]] + [r["load"][0] for r in rounds]
    say(f"{len(rounds)} rounds in {summary['seconds']:.0f} s, faults injected {counts}: "
        f"{sum(r['passed'] for r in rounds)} passed, {sum(not r['passed'] for r in rounds)} failed; "
        f"load (1 min) {min(loads):.1f}-{max(loads):.1f} (summary: {a.workdir / 'soak.json'})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
