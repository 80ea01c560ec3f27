"""Benchmark merging by world size: `ckptflow merge` at W=256 and W=1024 against a verl-style merger.

    python bench/bench_world.py --repeat 3

The model is the issue's tiny Qwen2 (4 layers, hidden 256, 51 tensors, ~50 MB fp32) saved in verl's
FSDP2 layout with W ranks by `ckptflow_testing.large_world` (one process, torch's fake process group,
real DTensor pickles). Checkpoints are kept under bench/_work (W=1024 takes ~30 s to write). Whole
processes, start-up included, warm page cache, medians of `--repeat`; the W=1024/W=256 ratio and the
ckptflow vs verl-style ratio come from the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from measure import median_run

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
WORLDS = (256, 1024)


def checkpoint(work: Path, world_size: int) -> Path:
    from ckptflow_testing.large_world import LargeWorldSpec, write_large_world

    root = work / f"world-{world_size}"
    role = root / "global_step_1" / "actor"
    if not (role / "fsdp_config.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"writing the W={world_size} checkpoint (once; kept in {work})...", flush=True)
        write_large_world(root, LargeWorldSpec(world_size=world_size))
    return role


def run(label: str, argv: list[str], out: Path, repeat: int, role: Path) -> dict:
    return median_run(label, argv, out, repeat, f"{role}/model_*.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-verl", action="store_true", help="time ckptflow only")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "out-world"
    roles = {w: checkpoint(args.work, w) for w in WORLDS}

    results: dict[int, dict] = {}
    for world, role in roles.items():
        size = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e6
        print(f"\nW={world}: {size:.0f} MB of rank files, medians of {args.repeat}")
        results[world] = {"ckptflow": run("ckptflow merge (verified)", [
            PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--dtype", "bf16", "--local_dir", str(role),
            "--target_dir", str(out)], out, args.repeat, role)}
        if not args.skip_verl:
            results[world]["verl"] = run("verl-style merger", [PYTHON, str(HERE / "verl_style_merge.py"), str(role),
                                                               str(out)], out, args.repeat, role)

    big, small = results[1024], results[256]
    print("\nratios (goals from issue 12 in brackets)")
    print(f"  ckptflow W=1024 / W=256: {big['ckptflow']['seconds'] / small['ckptflow']['seconds']:.2f}x whole process, "
          f"{big['ckptflow']['work_seconds'] / small['ckptflow']['work_seconds']:.2f}x after imports   [<= 4.5x]")
    if not args.skip_verl:
        print(f"  verl-style W=1024 / W=256: {big['verl']['seconds'] / small['verl']['seconds']:.2f}x whole process")
        for world in WORLDS:
            r = results[world]
            print(f"  W={world}: ckptflow {r['verl']['seconds'] / r['ckptflow']['seconds']:.2f}x faster than verl-style "
                  f"whole process, {r['verl']['work_seconds'] / r['ckptflow']['work_seconds']:.2f}x after imports"
                  + ("   [>= 2x]" if world == 1024 else ""))
    (args.work / "results-world.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
