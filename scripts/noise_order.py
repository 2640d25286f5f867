"""Run a `polyrl` command with the rollout's step noise drawn sample-major instead of step-major.

    python scripts/noise_order.py train trainer.seed=0 trainer.output_dir=runs/nft_s0_sm

Both orders are equally valid draws of the same distribution (`sampling/diffusion.draw_noise` draws the initial
noise, the window starts, then the step noise step-major). A learning result that holds for several seeds but not
for another order of the same draws depends on its noise stream: this script is how the default recipe's gain was
checked against that (README, "It learns"). The initial noise, and so every held-out ODE evaluation, is unchanged.
"""

from __future__ import annotations

import sys

import polyrl.sampling.diffusion as diffusion
from polyrl.cli.main import main

draw_noise_step_major = diffusion.draw_noise


def draw_noise_sample_major(shapes, plan, group_ids, generator, step=0, pin_memory=False):
    """The same draws as `draw_noise`; its step noise, one flat run of numbers, read sample by sample instead."""
    noise = draw_noise_step_major(shapes, plan, group_ids, generator, step, pin_memory)
    b = len(group_ids)
    steps = {k: v.reshape(b, plan.num_steps, *v.shape[2:]).transpose(0, 1).contiguous() for k, v in noise.steps.items()}
    return diffusion.RolloutNoise(noise.initial, noise.starts, steps)


if __name__ == "__main__":
    diffusion.draw_noise = draw_noise_sample_major
    sys.exit(main(sys.argv[1:]))
