"""Step time with and without `reward.async`, with a deliberately slow reward (CPU benchmark).

    OMP_NUM_THREADS=2 python scripts/bench_async_reward.py [--steps 4] [--delay 0.02] [--batch-size 16]
        [--http] [overrides...]

The reward is `shapes` plus `delay` seconds of sleep per image (a stand-in for a model on another device or
a remote service: it holds no CPU while it waits). `--http` serves that reward with a loopback
`polyrl serve-reward`-style server in this process and trains with `reward=http` instead. Each mode trains
the embedded toy_shapes recipe for `--steps` steps (no eval, no checkpoints) with `rollout.batch_size`
samples per chunk; the first step is a warm-up and is not counted. Prints mean seconds per step and stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from polyrl.rewards import build_reward, register_reward


@register_reward("slow_shapes")
class SlowShapes:
    """`shapes`, then `delay` seconds of sleep per image."""

    def __init__(self, delay: float = 0.02):
        self.inner, self.delay = build_reward({"name": "shapes"}), delay

    def __call__(self, images, prompts, metadata):
        out = self.inner(images, prompts, metadata)
        time.sleep(self.delay * len(prompts))
        return out


def run(overrides: list[str]) -> list[dict]:
    from polyrl.config import load_config
    from polyrl.trainer.loop import Trainer

    trainer = Trainer(load_config(overrides))
    trainer.fit()
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--delay", type=float, default=0.02, help="seconds of sleep per image in the reward")
    p.add_argument("--batch-size", type=int, default=16, help="rollout.batch_size: samples per chunk")
    p.add_argument("--http", action="store_true", help="score through a loopback reward server")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating (the CPU may be shared)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    server = None
    if a.http:
        from polyrl.serving.server import BackgroundServer, create_app

        server = BackgroundServer(create_app(SlowShapes(a.delay), "slow_shapes")).start()
        reward = ["reward=http", f"reward.url={server.url}"]
    else:
        reward = ["reward.name=slow_shapes", f"+reward.delay={a.delay}"]
    keys = ("time/step", "time/rollout", "time/decode", "time/reward", "time/reward_wait", "time/train", "reward/mean")
    timed: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for overlap in (False, True):
                overrides = [*reward, f"reward.async={str(overlap).lower()}", f"trainer.max_steps={a.steps}",
                             "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
                             "trainer.tensorboard=false", f"rollout.batch_size={a.batch_size}",
                             f"trainer.output_dir={Path(tmp) / f'{overlap}_{rep}'}", *a.overrides]
                timed[overlap] += run(overrides)[1:]  # each run's step 1 is a warm-up
    rows = [(overlap, {k: statistics.mean(m.get(k, 0.0) for m in ms) for k in keys}) for overlap, ms in timed.items()]
    if server is not None:
        server.stop()
    print(f"\nslow reward: {a.delay} s/image, rollout.batch_size={a.batch_size}, {len(timed[True])} timed steps per mode"
          f"{', via loopback HTTP' if a.http else ''}")
    print("| reward.async | step s | step − train s | rollout s | decode s | reward s | reward wait s | train s | reward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for overlap, m in rows:
        print(f"| {str(overlap).lower()} | {m['time/step']:.2f} | {m['time/step'] - m['time/train']:.2f} | "
              f"{m['time/rollout']:.2f} | {m['time/decode']:.2f} | {m['time/reward']:.2f} | "
              f"{m['time/reward_wait']:.2f} | {m['time/train']:.2f} | {m['reward/mean']:.4f} |")
    print("(sync: decode and reward run after the rollout; async: they run in a worker during it, and only the "
          "'reward wait' is left after it)")


if __name__ == "__main__":
    main()
