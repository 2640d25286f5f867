"""Held-out evaluation: the math, pure functions of numbers (stats.py: paired statistics over prompts; hacking.py:
the reward-hacking watch), which the trainer's evaluations use too; and `polyrl eval`'s engine (engine.py runs it;
plan.py: what is sampled and how, report.py: the output directory and report, grids.py: gains and losses grids),
which sits above the trainer. This file imports nothing, so the trainer reads stats and hacking without it."""
