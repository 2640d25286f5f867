"""Held-out evaluation math: paired statistics over prompts (stats.py) and the reward-hacking watch (hacking.py).
Pure functions of numbers; the sampling that produces them is `polyrl eval` (cli/evaluate.py) and the trainer."""
