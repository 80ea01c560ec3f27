"""`ckptflow merge ARGS...` as the console script runs it, printing the seconds spent after the imports
(work_seconds). It imports what the CLI imports and no more: the FSDP path never imports torch."""

import sys
import time

import mergecore.engine.merge  # noqa: F401
from ckptflow.flows.cli import app

started = time.perf_counter()
app(sys.argv[1:], prog_name="ckptflow", standalone_mode=False)
print(f"work_seconds={time.perf_counter() - started:.3f}")
