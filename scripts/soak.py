"""Soak: the toy recipe trained deterministically, in rounds, for a given time while faults are injected at random
steps; each round must end with every step once in metrics.jsonl and the final LoRA weights (and every logged
number but times) equal to an uninterrupted deterministic run's of the same length (docs/checkpoints.md).

    nice -n 19 python scripts/soak.py --minutes 30                 # rounds of 16 steps, faults at random steps
    python scripts/soak.py --minutes 5 --steps 8 --seed 1 --workdir /tmp/soak

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
Every run resumes with trainer.resume=auto. The summary (faults, exits, checks) is printed and written as JSON to
<workdir>/soak.json; the exit code is 0 only when every round passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
FAULTS = ("reward_blip", "reward_outage", "sigterm", "kill9_save", "disk_full")
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


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    env.pop("POLYRL_SOAK_FAULT", None)
    return {**env, **(extra or {})}


class RewardServer:
    """`polyrl serve-reward reward=shapes` on a fixed port, killed and restarted by the faults."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None

    def start(self, timeout: float = 180.0) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(polyrl("serve-reward", "reward=shapes", "--port", str(self.port)),
                                         env=child_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
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


def attempt(args: list[str], run_dir: Path, log: Path, faults: list[dict], server: RewardServer, disk: Disk,
            extra_env: dict) -> tuple[int, str, dict | None]:
    """One `polyrl train` process. `faults`: the round's pending faults, in step order; the reward blips before the
    first other fault are injected in this process once it has trained a step and reached theirs (each marked
    absorbed when the run goes on), then that other fault, which should end the process (an external one injected here, a
    kill9_save / patched ENOSPC armed through `extra_env`). Returns (exit code, stderr, the fault injected that
    should have ended the process, or None)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(polyrl(*args), env=child_env(extra_env), stdout=subprocess.DEVNULL, stderr=err,
                                cwd=REPO)
    ending = next((f for f in faults if f["kind"] != "reward_blip"), None)
    blips = [f for f in faults if f["kind"] == "reward_blip" and (ending is None or f["step"] < ending["step"])]
    armed = ending is not None and ending["kind"] in ("kill9_save",) or (
        ending is not None and ending["kind"] == "disk_full" and not disk.tmpfs)
    injected, baseline = None, None
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if baseline is None:  # faults wait for this process to train a step (signal handlers installed)
                if "polyrl: run directory" in log.read_text(errors="replace"):
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
            elif kind == "sigterm":
                proc.send_signal(signal.SIGTERM)
            elif kind == "disk_full":
                ending["note"] = f"filled {disk.fill(ending['leave'])} bytes at step {step}, {ending['leave']} left free"
        if armed and proc.returncode != 0:
            injected = ending
        return proc.returncode, log.read_text(errors="replace"), injected
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def expected(kind: str, code: int, err: str) -> tuple[bool, str]:
    """Whether a process that a fault of `kind` ended ended as it should, and why not."""
    errors = [line for line in err.splitlines() if line.startswith("polyrl: error:")]
    if "Traceback" in err:
        return False, "a traceback"
    if kind == "reward_outage":
        return code == 3 and "polyrl: stopped:" in err, f"exit {code}"
    if kind == "sigterm":
        return code == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, f"exit {code}"
    if kind == "kill9_save":
        return code == -signal.SIGKILL and "soak_faults: SIGKILL" in err, f"exit {code}"
    if kind == "disk_full":
        ok = code == 2 and len(errors) == 1 and errors[0].startswith("polyrl: error: disk full:")
        return ok, f"exit {code}, error lines {errors}"
    return False, f"exit {code} (the run should not have stopped)"


_BAG: list[str] = []


def draw_kind(rng: random.Random, kinds: tuple[str, ...]) -> str:
    """The next fault kind: every kind once, in a shuffled order, then again (each kind equally often)."""
    if not _BAG:
        _BAG.extend(rng.sample(kinds, len(kinds)))
    return _BAG.pop()


def run_round(i: int, rng: random.Random, steps: int, work: Path, disk: Disk, server: RewardServer,
              reference: Path, kinds: tuple[str, ...] = FAULTS) -> dict:
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
        args = train_args(run_dir, steps, server.port) + (["--import", str(FAULT_MODULE)] if env else [])
        processes += 1
        code, err, fault = attempt(args, run_dir, logs / f"process_{processes:02d}.err", pending, server, disk, env)
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
        ok, why = expected(fault["kind"], code, err)
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
    p.add_argument("--tmpfs-mb", type=int, default=32)
    p.add_argument("--faults", default=",".join(FAULTS), help="the kinds to draw from, comma-separated")
    a = p.parse_args()
    kinds = tuple(k for k in a.faults.split(",") if k)
    if not kinds or set(kinds) - set(FAULTS):
        p.error(f"--faults: give some of {', '.join(FAULTS)}")
    if a.steps < 4:
        p.error("--steps must be >= 4")
    shutil.rmtree(a.workdir, ignore_errors=True)
    a.workdir.mkdir(parents=True)
    rng = random.Random(a.seed)
    deadline = time.monotonic() + a.minutes * 60
    server = RewardServer(free_port(), a.workdir / "reward_server.log")
    disk = Disk(a.workdir / "disk", a.tmpfs_mb)
    summary = {"steps": a.steps, "seed": a.seed, "minutes": a.minutes, "tmpfs": disk.tmpfs, "faults": kinds,
               "rounds": []}
    t0 = time.monotonic()
    try:
        server.start()
        say(f"reward server on port {server.port}; run directories on "
            + (f"a {a.tmpfs_mb} MiB tmpfs" if disk.tmpfs else "the plain disk (no tmpfs: ENOSPC is patched in)"))
        reference = a.workdir / "reference"
        code = subprocess.run(polyrl(*train_args(reference, a.steps, server.port)), env=child_env(), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=open(a.workdir / "reference.err", "w")).returncode
        if code != 0:
            say(f"the uninterrupted reference run failed ({code}); see {a.workdir / 'reference.err'}")
            return 1
        summary["reference_seconds"] = round(time.monotonic() - t0, 1)
        say(f"reference run of {a.steps} steps: {summary['reference_seconds']} s")
        i = 0
        while i == 0 or time.monotonic() < deadline:  # at least one round
            summary["rounds"].append(run_round(i, rng, a.steps, a.workdir, disk, server, reference, kinds))
            i += 1
            (a.workdir / "soak.json").write_text(json.dumps(summary, indent=1))
    finally:
        server.kill()
        disk.close()
    rounds = summary["rounds"]
    faults = [f for r in rounds for f in r["faults"]]
    counts = {k: sum(f["kind"] == k and ("note" in f or "exit" in f.get("result", "")) for f in faults) for k in FAULTS}
    summary["faults_injected"] = counts
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["passed"] = bool(rounds) and all(r["passed"] for r in rounds)
    (a.workdir / "soak.json").write_text(json.dumps(summary, indent=1))
    say(f"{len(rounds)} rounds in {summary['seconds']:.0f} s, faults injected {counts}: "
        f"{sum(r['passed'] for r in rounds)} passed, {sum(not r['passed'] for r in rounds)} failed "
        f"(summary: {a.workdir / 'soak.json'})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
