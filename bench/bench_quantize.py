"""Benchmark `ckptflow merge --quantize` against the bf16 merge of the same checkpoint, whole processes, in one run.

    python bench/bench_quantize.py [--layers 4] [--repeat 3] [--schemes fp8-block,w8a16,w4a16]

Uses bench_merge's real FSDP2 checkpoint (W=4, Qwen2-like: hidden 2048, intermediate 5632, vocab 32000; every
quantized dim a multiple of 128), written once under bench/_work. Each round runs the bf16 merge and every
scheme once, alternating, each verified as a user would run it (round trip on); prints medians of wall seconds
and peak private memory, and each scheme's ratio to bf16 (goal: <= 1.3x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_merge import checkpoint
from measure import alternating_medians

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--schemes", default="fp8-block,w8a16,w4a16")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    role = checkpoint(args.work, args.layers)
    out = args.work / "out-quantize"
    merge = [sys.executable, "-m", "ckptflow.flows.cli", "merge", "--dtype", "bf16", "--local_dir", str(role),
             "--target_dir", str(out)]
    contenders = {"bf16": (merge, None)}
    contenders.update({scheme: ([*merge, "--quantize", scheme], None) for scheme in args.schemes.split(",")})
    print(f"{args.layers}-layer checkpoint, medians of {args.repeat} alternating rounds (whole process, verified)")
    medians = alternating_medians(contenders, out, args.repeat, f"{role}/model_*.pt")
    for scheme in contenders:
        if scheme != "bf16":
            ratio = medians[scheme]["seconds"] / medians["bf16"]["seconds"]
            print(f"  {scheme} / bf16: {ratio:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
