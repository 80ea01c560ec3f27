"""Start-up: the imports of a merge against `import numpy`, whole processes, in one run.

    python bench/bench_imports.py [--repeat 15]

Each sample is a fresh `python -c ...` (interpreter start included in both). The merge's imports are
what `ckptflow merge` loads before it touches a file: the CLI (typer, rich), the merge, the FSDP and
dist_ckpt readers' torch-free parts, the writer, the round-trip check. Goal: ≤ 3× `import numpy`.
It also lists any heavy module (torch, transformers, ml_dtypes, prefect) those imports pulled in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MERGE_IMPORTS = ("ckptflow.flows.cli", "mergecore", "mergecore.engine.merge", "mergecore.formats.fsdp", "mergecore.formats.torchfile",
                 "mergecore.formats.untrusted", "mergecore.engine.writer", "mergecore.model.manifest", "mergecore.targets.publish",
                 "mergecore.proofs.verify", "mergecore.numbers.arrays", "mergecore.quantize.stream")
HEAVY = ("torch", "transformers", "ml_dtypes", "prefect", "megatron", "compressed_tensors")


def seconds(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    merge_code = "import " + ", ".join(MERGE_IMPORTS)
    cases = {"python -c pass": "pass", "import numpy": "import numpy", "the merge's imports": merge_code,
             "from mergecore import CheckpointError": "from mergecore import CheckpointError"}
    samples = {label: [] for label in cases}
    for _ in range(args.repeat):  # interleaved, so load changes hit every case alike
        for label, code in cases.items():
            samples[label].append(seconds(code))
    medians = {label: statistics.median(values) for label, values in samples.items()}
    print(f"medians of {args.repeat} whole processes")
    for label, value in medians.items():
        print(f"  {label:<40} {value * 1000:7.0f} ms   {value / medians['import numpy']:5.2f}x numpy")
    heavy = subprocess.run([sys.executable, "-c", merge_code + "; import sys; print(sorted({m.split('.')[0] for m in "
                            f"sys.modules}} & set({HEAVY!r})))"], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT).stdout.strip()
    ratio = medians["the merge's imports"] / medians["import numpy"]
    print(f"\n  merge imports / import numpy: {ratio:.2f}x "
          f"(goal <= 3x); heavy modules loaded: {heavy}")


if __name__ == "__main__":
    main()
