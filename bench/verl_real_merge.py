"""verl's real merger (`python -m verl.model_merger ARGS...`), printing the seconds spent after its imports
(work_seconds). Needs verl on the path: see `verl_site.py` for installing it into bench/_work/verl-site."""

import sys
import time

import verl.model_merger.fsdp_model_merger  # noqa: F401  (imported by main() for --backend fsdp)
from verl.model_merger.__main__ import main

if __name__ == "__main__":
    started = time.perf_counter()
    sys.argv[0] = "verl.model_merger"
    main()
    print(f"work_seconds={time.perf_counter() - started:.3f}")
