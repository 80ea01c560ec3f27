"""`ckptflow merge ARGS...` in this process, printing the seconds spent after the imports (work_seconds)."""

import sys
import time

import torch  # noqa: F401  - imports are what every contender pays before working
import torch.distributed.tensor  # noqa: F401

import mergecore  # noqa: F401
from flows.cli import app

started = time.perf_counter()
app(sys.argv[1:], prog_name="ckptflow", standalone_mode=False)
print(f"work_seconds={time.perf_counter() - started:.3f}")
