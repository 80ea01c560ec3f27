"""Baseline for Megatron dist_ckpt: torch's `dcp_to_torch_save` of the whole folder, then a full `torch.load`."""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def main(dist_dir: str, scratch: str) -> None:
    full = Path(scratch) / "full.pt"
    full.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(dist_dir, str(full))
    state = torch.load(full, map_location="cpu", weights_only=False)  # the bench's own file: trusted here
    assert state, "empty checkpoint"


if __name__ == "__main__":
    started = time.perf_counter()
    main(*sys.argv[1:3])
    print(f"work_seconds={time.perf_counter() - started:.3f}")
