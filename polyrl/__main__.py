"""`python -m polyrl ...` (and `torchrun --nproc-per-node=N -m polyrl train ...`): the `polyrl` command."""

import sys

from .cli.main import main

sys.exit(main())
