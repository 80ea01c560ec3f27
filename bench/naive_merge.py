"""Baseline: what existing mergers do. Load every rank file fully, concatenate, cast, save one file."""

import re
import sys
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401
from safetensors.torch import save_file


def main(role_dir: str, target: str) -> None:
    files = sorted(Path(role_dir).glob("model_world_size_*_rank_*.pt"),
                   key=lambda p: int(re.search(r"rank_(\d+)", p.name)[1]))
    states = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    merged = {}
    for name, first in states[0].items():
        dim = first.placements[0].dim
        merged[name] = torch.cat([s[name].to_local() for s in states], dim=dim).to(torch.bfloat16)
    Path(target).mkdir(parents=True, exist_ok=True)
    save_file(merged, f"{target}/model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    main(*sys.argv[1:3])
