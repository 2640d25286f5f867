"""`polyrl serve-reward` as a real process, killed (SIGKILL) and restarted while a client is scoring.

The run must go on, every sample must get exactly one score, its own: the served reward echoes each sample's
id and the server call that scored it, and logs every call it makes, so the test can check that each sample
was scored by exactly one call among the answers the client accepted, and that call really happened.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch

from polyrl.rewards import build_reward

RECORDING_REWARD = '''
import json, os, time, uuid

from polyrl.rewards import RewardOutput, register_reward
from polyrl.rewards.jpeg import jpeg_kilobytes


@register_reward("recording")
class Recording:
    def __init__(self, log: str, delay: float = 0.0):
        self.log, self.delay = log, delay

    def __call__(self, images, prompts, metadata):
        call, sids = uuid.uuid4().hex, [m["sid"] for m in metadata]
        with open(self.log, "a") as f:  # logged before the work: a call killed mid-way is in the log too
            f.write(json.dumps({"pid": os.getpid(), "call": call, "sids": sids}) + "\\n")
        time.sleep(self.delay)
        return RewardOutput(-jpeg_kilobytes(images, 95), {"sid": sids, "call": [call] * len(sids),
                                                          "pid": [os.getpid()] * len(sids)})
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, port, log):
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "polyrl.cli.main", "serve-reward", "reward=recording", f"reward.log={log}",
           "reward.delay=0.03", "--import", "recording_reward", "--port", str(port), "--max-batch", "2",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve-reward exited: {proc.stderr.read().decode()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("serve-reward did not come up in 60 s")


def test_server_killed_and_restarted_mid_run(tmp_path):
    (tmp_path / "recording_reward.py").write_text(RECORDING_REWARD)
    log, port = tmp_path / "calls.jsonl", _free_port()
    procs = [_start(tmp_path, port, log)]
    client = build_reward({"name": "http", "url": f"http://127.0.0.1:{port}", "chunk_size": 2, "max_concurrency": 4,
                           "max_retries": 40, "backoff": 0.05, "max_backoff": 0.5, "timeout": 30})
    local = build_reward({"name": "jpeg_compressibility"})
    restarted = threading.Event()

    def kill_and_restart():
        time.sleep(0.6)  # some batches in
        procs[0].kill()
        procs[0].wait()
        procs.append(_start(tmp_path, port, log))
        restarted.set()

    killer = threading.Thread(target=kill_and_restart)
    killer.start()
    accepted = []  # (call id, sample id) of every score the client returned
    num_batches, after_restart, b = 0, 0, 8
    try:
        while after_restart < 3:  # keep scoring until a few batches went to the restarted server
            assert num_batches < 400, "the restart never happened"
            after_restart += restarted.is_set()
            sids = list(range(num_batches * b, (num_batches + 1) * b))
            images = torch.rand(b, 3, 16, 16, generator=torch.Generator().manual_seed(num_batches))
            out = client(images, ["p"] * b, [{"sid": s} for s in sids])
            assert out.extras["sid"] == sids  # each score is its own sample's
            assert torch.equal(out.scores, local(images, ["p"] * b, [{}] * b).scores)
            accepted += list(zip(out.extras["call"], out.extras["sid"], strict=True))
            num_batches += 1
    finally:
        killer.join()
        for p in procs:
            p.kill()
            p.wait()
    total = num_batches * b
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    by_call = {c["call"]: c for c in calls}
    # no sample lost, none scored twice among the accepted answers
    assert sorted(s for _, s in accepted) == list(range(total))
    # every accepted score came from a call the server really made, on exactly those samples
    for call, sid in accepted:
        assert sid in by_call[call]["sids"]
    assert len({c["pid"] for c in calls}) == 2  # both server processes scored part of the run
    assert client.stats["retries"] > 0  # the client did see the outage
