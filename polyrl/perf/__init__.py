"""Performance tooling: analytic FLOP counts (docs/algorithms.md §6), stage timers and `polyrl bench`."""
