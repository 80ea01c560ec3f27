"""Baseline for torch distributed checkpoints: torch's `dcp_to_torch_save` of the whole folder, then a full
`torch.load`; with HF_DIR and OUT also what a user then does to get a Hugging Face folder: the model built from
HF_DIR's config, the state loaded into it, and `save_pretrained` in bf16.

    python bench/dcp_full_load.py DCP_DIR SCRATCH [HF_DIR OUT]
"""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def main(dist_dir: str, scratch: str, hf_dir: str | None = None, out: str | None = None) -> None:
    full = Path(scratch) / "full.pt"
    full.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(dist_dir, str(full))
    state = torch.load(full, map_location="cpu", weights_only=False)  # the bench's own file: trusted here
    assert state, "empty checkpoint"
    if hf_dir:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(hf_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state, strict=True, assign=True)
        model.to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    started = time.perf_counter()
    main(*sys.argv[1:5])
    print(f"work_seconds={time.perf_counter() - started:.3f}")
