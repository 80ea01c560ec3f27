"""Baseline: what existing mergers do. Load every rank file fully, concatenate, cast, save one file."""

import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401
from safetensors.torch import save_file


def load_and_concatenate(role_dir: str) -> dict:
    """Every rank file loaded whole into memory, shards concatenated along their placement, cast to bf16."""
    files = sorted(Path(role_dir).glob("model_world_size_*_rank_*.pt"),
                   key=lambda p: int(re.search(r"rank_(\d+)", p.name)[1]))
    states = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    return {name: torch.cat([s[name].to_local() for s in states], dim=first.placements[0].dim).to(torch.bfloat16)
            for name, first in states[0].items()}


def main(role_dir: str, target: str) -> None:
    merged = load_and_concatenate(role_dir)
    Path(target).mkdir(parents=True, exist_ok=True)
    save_file(merged, f"{target}/model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    started = time.perf_counter()
    main(*sys.argv[1:3])
    print(f"work_seconds={time.perf_counter() - started:.3f}")
