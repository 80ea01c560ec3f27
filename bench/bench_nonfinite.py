"""Cost of the NaN/Inf check in the merge: the same merge with and without it, alternating.

    python bench/bench_nonfinite.py --layers 2 --repeat 7     # ~0.9 GB fp32 checkpoint, to bf16

Uses bench_merge.py's FSDP2 checkpoint (W=4, Qwen2-like, hidden 2048; kept under bench/_work).
Times the merge phase (pre-size files, read, cast, check, write: the manifest's `merge` lap) in this
process, skip-verify, with the check on and with `nonfinite_counts` replaced by a no-op; input
re-warmed before every sample. Prints medians, the median of pair ratios, and the check alone
over every converted tensor.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_merge import checkpoint, warm  # noqa: E402


def merge_seconds(role: Path, out: Path, check: bool) -> float:
    import mergecore.numbers.nonfinite as policy  # where the merge's writer calls the check
    from mergecore import merge_checkpoint
    from mergecore.numbers.arrays import nonfinite_counts

    policy.nonfinite_counts = nonfinite_counts if check else (lambda array: None)
    try:
        shutil.rmtree(out, ignore_errors=True)
        warm(f"{role}/model_*.pt")
        manifest = merge_checkpoint(str(role), out, dtype="bf16", verify=False)
        return manifest["timings"]["merge"]
    finally:
        policy.nonfinite_counts = nonfinite_counts
        shutil.rmtree(out, ignore_errors=True)


def check_alone(role: Path) -> tuple[float, int]:
    """Seconds of `nonfinite_counts` over every converted tensor, and how many bytes it looked at."""
    from mergecore import prepare
    from mergecore.numbers.arrays import nonfinite_counts

    prepared = prepare(str(role), dtype="bf16")
    seconds = checked = 0
    for entry in prepared.plan.tensors:
        tensor = prepared.source.read(entry.name, entry.dtype)
        started = time.perf_counter()
        nonfinite_counts(tensor)
        seconds += time.perf_counter() - started
        checked += entry.end - entry.begin
    return seconds, checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    role = checkpoint(args.work, args.layers)
    out = args.work / "out-nonfinite"
    size = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e9
    merge_seconds(role, out, True)  # imports, first-touch costs

    with_check, without, ratios = [], [], []
    for i in range(args.repeat):
        order = (True, False) if i % 2 == 0 else (False, True)
        pair = {check: merge_seconds(role, out, check) for check in order}
        with_check.append(pair[True])
        without.append(pair[False])
        ratios.append(pair[True] / pair[False])
    alone, checked = check_alone(role)
    print(f"{args.layers} layers, {size:.2f} GB fp32 -> bf16, merge phase, medians of {args.repeat} alternating pairs:")
    print(f"  with the NaN/Inf check     {statistics.median(with_check):6.3f} s")
    print(f"  without                    {statistics.median(without):6.3f} s")
    print(f"  median pair ratio          {statistics.median(ratios):6.3f}   [goal <= 1.05]")
    print(f"  the check alone            {alone:6.3f} s for {checked / 1e9:.2f} GB of bf16 "
          f"({alone / statistics.median(without):.1%} of the merge phase, one thread)")


if __name__ == "__main__":
    main()
