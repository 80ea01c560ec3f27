"""Baseline: the shape of verl's FSDP model merger. Load every rank fully, concatenate by placement,
cast, then let transformers write the folder (`save_pretrained`) and copy the tokenizer."""

import re
import sys
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main(role_dir: str, target: str) -> None:
    files = sorted(Path(role_dir).glob("model_world_size_*_rank_*.pt"),
                   key=lambda p: int(re.search(r"rank_(\d+)", p.name)[1]))
    states = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    merged = {}
    for name, first in states[0].items():
        merged[name] = torch.cat([s[name].to_local() for s in states], dim=first.placements[0].dim).bfloat16()
    hf_dir = Path(role_dir) / "huggingface"
    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target, state_dict=merged)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(target)


if __name__ == "__main__":
    main(*sys.argv[1:3])
