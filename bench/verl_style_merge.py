"""Baseline: the shape of verl's FSDP model merger. Load every rank fully, concatenate by placement,
cast, then let transformers write the folder (`save_pretrained`) and copy the tokenizer."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401
from naive_merge import load_and_concatenate
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main(role_dir: str, target: str) -> None:
    merged = load_and_concatenate(role_dir)
    hf_dir = Path(role_dir) / "huggingface"
    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target, state_dict=merged)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(target)


if __name__ == "__main__":
    started = time.perf_counter()
    main(*sys.argv[1:3])
    print(f"work_seconds={time.perf_counter() - started:.3f}")
