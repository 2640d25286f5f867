"""Performance tooling: analytic FLOP counts (ALGORITHMS.md §6), stage timers and `polyrl bench`."""
