"""Run a `polyrl` command with the rollout's step noise drawn sample-major instead of step-major.

    python scripts/noise_order.py train trainer.seed=0 trainer.output_dir=runs/nft_s0_sm

Both orders are equally valid draws of the same distribution (`sampling/diffusion.draw_noise` draws the initial
noise, the window starts, then the step noise step-major). A learning result that holds for several seeds but not
for another order of the same draws depends on its noise stream: this script is how the default recipe's gain was
checked against that (README, "It learns"). The initial noise, and so every held-out ODE evaluation, is unchanged.
"""

from __future__ import annotations

import sys

import torch

import polyrl.sampling.diffusion as diffusion
from polyrl.cli.main import main
from polyrl.latents import cat_latents


def draw_noise_sample_major(shapes, plan, group_ids, generator, step=0, pin_memory=False):
    def one():
        return {k: torch.randn((1, *s), generator=generator, dtype=torch.float32) for k, s in shapes.items()}

    b = len(group_ids)
    if plan.shared_noise:
        _, group_index = torch.unique(group_ids, return_inverse=True)
        per_group = cat_latents([one() for _ in range(int(group_index.max()) + 1)])
        initial = {k: v[group_index] for k, v in per_group.items()}
    else:
        initial = cat_latents([one() for _ in range(b)])
    starts = diffusion.window_starts(plan, b, generator, step)
    steps = {k: torch.randn((b, plan.num_steps, *s), generator=generator).transpose(0, 1).contiguous()
             for k, s in shapes.items()}
    return diffusion.RolloutNoise(initial, starts, steps)


if __name__ == "__main__":
    diffusion.draw_noise = draw_noise_sample_major
    sys.exit(main(sys.argv[1:]))
