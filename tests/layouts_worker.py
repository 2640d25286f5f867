"""Run several `polyrl train` commands one after the other in each torchrun rank (conftest.launch_runs: test_layouts.py, test_distributed.py): one launch
instead of one per algorithm. argv: plan.json ({name: [train, args...]}), codes.json (rank 0 writes each run's
exit code there).

The process group is set up once and kept for every run (a run's engine finds it and uses it; its close, which
would tear it down, is a barrier here): re-creating a gloo group in a process has hung after a few rounds."""

import json
import os
import sys

import torch
import torch.distributed as dist

from polyrl.cli.main import main
from polyrl.distributed.engine import DataParallelEngine, init_process_group

torch.set_num_threads(1)
init_process_group("gloo")
DataParallelEngine.close = lambda self, barrier=True: dist.barrier()
plan = json.loads(open(sys.argv[1]).read())
codes = {}
for name, args in plan.items():
    codes[name] = main(args)
    dist.barrier()  # a run refused before its engine's close (a config error) still leaves both ranks in step
if os.environ.get("RANK", "0") == "0":
    with open(sys.argv[2], "w") as f:
        json.dump(codes, f)
dist.destroy_process_group()
