"""Benchmark a torch distributed checkpoint (DCP) to a bf16 Hugging Face folder: `ckptflow merge --backend dcp`
against `dcp_to_torch_save` + `save_pretrained` (bench/dcp_full_load.py), whole processes, time and private memory.

    python bench/bench_dcp.py --repeat 3

The checkpoint: a Llama of hidden 1024, 4 layers, vocabulary 152064 (1.3 GB fp32, the embeddings 0.62 GB each),
trained one step on 2 gloo ranks with FSDP2 and saved by `dcp.save` (ckptflow.testing's demo writer); kept under
bench/_work. Warm page cache, alternating contenders, medians of `--repeat`; ckptflow's output is compared with the
baseline's tensor by tensor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from measure import alternating_medians

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def checkpoint(work: Path):
    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    root = work / "dcp-llama-152k"
    if not (root / "reference" / "config.json").exists():
        print(f"writing the DCP checkpoint (once; kept in {work})...", flush=True)
        write_demo_checkpoint(root, DemoSpec(arch="llama", save="dcp", vocab_size=152064, hidden_size=1024,
                                             intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                                             num_key_value_heads=4))
    return root / "global_step_1" / "actor", root / "reference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    role, hf_dir = checkpoint(args.work)
    out = args.work / "out-dcp"
    contenders = {
        "ckptflow merge --backend dcp (verified)": ([PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--backend", "dcp",
                                                     "--local_dir", str(role), "--hf_model_path", str(hf_dir),
                                                     "--target_dir", str(out / "ckptflow"), "--dtype", "bf16"], None),
        "dcp_to_torch_save + save_pretrained": ([PYTHON, str(HERE / "dcp_full_load.py"), str(role), str(out / "scratch"),
                                                 str(hf_dir), str(out / "baseline")], None),
    }
    medians = alternating_medians(contenders, out, args.repeat, f"{role}/*")
    ours, base = medians.values()
    print(f"ratio: {base['seconds'] / ours['seconds']:.2f}x faster, {ours['anon_mib'] / base['anon_mib']:.3f}x the "
          "private memory")
    for argv, _ in contenders.values():  # one more run each, kept, to compare the outputs
        subprocess.run(argv, check=True, capture_output=True)
    mine, theirs = tensors(out / "ckptflow"), tensors(out / "baseline")
    assert sorted(mine) == sorted(theirs) and all(mine[n].equal(theirs[n]) for n in theirs), "outputs differ"
    print("outputs: identical tensors")


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}


if __name__ == "__main__":
    main()
