"""Where a verified merge's time goes, by phase, on bench_merge's 2.33 GB checkpoint (W=4 FSDP2 fp32 -> bf16).

    python bench/phases.py [--layers 10] [--rounds 3]

Runs `mergecore.merge` in this process after warming the page cache (the CLI's merge, without its start-up), with
timers wrapped around the functions each phase runs in. Two kinds of figures:
- wall seconds of the merge's own phases (its manifest's `timings`: prepare = open, index, validate, plan;
  merge = every group written; verify = round trip, descriptive files; then publish, measured here);
- thread-seconds inside each activity, summed over the threads that run it (two merge workers, the CRC pool,
  the background sha256): more than the wall time when they overlap. `read + convert` is the cast of each
  piece's rows into its block, which is also where the mmapped rank files are first touched (page-cache faults).
Medians over `--rounds`; one process, so the first round also pays the imports' first use (dropped).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_merge import checkpoint  # noqa: E402
from measure import warm  # noqa: E402

_spent: dict[str, float] = defaultdict(float)
_lock = threading.Lock()


def timed(owner, name: str, label: str) -> None:
    """Wrap `owner.name` so that the seconds spent in it add up under `label`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            with _lock:
                _spent[label] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def install_timers() -> None:
    import mergecore.assembly.folder as folder
    import mergecore.engine.hashes as hashes
    import mergecore.formats.base as base
    import mergecore.formats.fetching as fetching
    import mergecore.numbers.arrays as arrays
    import mergecore.numbers.nonfinite as nonfinite
    import mergecore.targets.local as local

    timed(fetching, "check_crc", "read: CRC-32 of the members")
    timed(arrays, "cast_into", "read + convert (page faults, cast)")
    timed(nonfinite, "nonfinite_counts", "NaN/Inf check")
    timed(os, "pwrite", "write (pwrite)")
    timed(os, "fsync", "fsync")
    timed(base.CheckpointSource, "check_round_trip", "round trip")
    timed(hashes.BackgroundHashes, "_advance", "sha256 (background)")
    timed(folder, "write_beside_weights", "descriptive files")
    timed(local.LocalTarget, "publish", "publish (fsync, rename)")


def one_merge(role: Path, out: Path) -> tuple[dict, float]:
    from mergecore import merge_checkpoint

    shutil.rmtree(out, ignore_errors=True)
    warm(f"{role}/model_*.pt")
    _spent.clear()
    started = time.perf_counter()
    manifest = merge_checkpoint(str(role), out, dtype="bf16")
    return {**manifest["timings"], **dict(_spent)}, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    role = checkpoint(args.work, args.layers)
    out = args.work / "out-phases"
    install_timers()
    one_merge(role, out)  # first use of every import
    samples = [one_merge(role, out) for _ in range(args.rounds)]
    shutil.rmtree(out, ignore_errors=True)
    total = statistics.median(seconds for _, seconds in samples)
    size = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e9
    print(f"{args.layers} layers, {size:.2f} GB fp32 -> bf16, verified; medians of {args.rounds}; whole merge "
          f"{total:.2f} s (in process, after imports)")
    print("| phase or activity | seconds |\n|---|---|")
    for label in samples[0][0]:
        print(f"| {label} | {statistics.median(timings.get(label, 0.0) for timings, _ in samples):.2f} |")


if __name__ == "__main__":
    main()
