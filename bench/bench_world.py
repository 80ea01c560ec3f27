"""Benchmark merging by world size: `ckptflow merge` at W=256 and W=1024 against a verl-style merger.

    python bench/bench_world.py --repeat 3

The model is the issue's tiny Qwen2 (4 layers, hidden 256, 51 tensors, ~50 MB fp32) saved in verl's
FSDP2 layout with W ranks by `ckptflow.testing.large_world` (one process, torch's fake process group,
real DTensor pickles). Checkpoints are kept under bench/_work (W=1024 takes ~30 s to write). Whole
processes, start-up included, warm page cache, medians of `--repeat`; the W=1024/W=256 ratio and the
ckptflow vs verl-style ratio come from the same run; at each world size the contenders alternate (one
sample of each per round).

    python bench/bench_world.py --repeat 3 --verl-site bench/_work/verl-site   # adds verl's real merger

`--verl-site` is a folder holding verl 0.9.1 and the few packages its merger imports, installed with
`pip install --no-deps --target` (never into the project's env): see bench/verl_site.py. Its output is
compared with ours tensor by tensor at each world size. `--skip-verl` leaves out the verl-style imitation
(bench/verl_style_merge.py), which is slow at W=1024.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import verl_site
from measure import alternating_medians

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
WORLDS = (256, 1024)


def checkpoint(work: Path, world_size: int) -> Path:
    from ckptflow.testing.large_world import LargeWorldSpec, write_large_world

    root = work / f"world-{world_size}"
    role = root / "global_step_1" / "actor"
    if not (role / "fsdp_config.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"writing the W={world_size} checkpoint (once; kept in {work})...", flush=True)
        write_large_world(root, LargeWorldSpec(world_size=world_size))
    return role


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-verl", action="store_true", help="leave out the verl-style imitation")
    parser.add_argument("--verl-site", type=Path, help="folder with verl 0.9.1 installed (bench/verl_site.py)")
    args = parser.parse_args()
    if args.verl_site:
        verl_site.check_site(args.verl_site)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "out-world"
    roles = {w: checkpoint(args.work, w) for w in WORLDS}

    results: dict[int, dict] = {}
    for world, role in roles.items():
        size = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e6
        print(f"\nW={world}: {size:.0f} MB of rank files, medians of {args.repeat}")
        ckptflow = [PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--dtype", "bf16", "--local_dir", str(role),
                    "--target_dir"]
        contenders = {"ckptflow": ("ckptflow merge (verified)", [*ckptflow, str(out)], None)}
        if not args.skip_verl:
            contenders["verl"] = ("verl-style merger", [PYTHON, str(HERE / "verl_style_merge.py"), str(role), str(out)], None)
        if args.verl_site:
            contenders["verl_real"] = (verl_site.LABEL, verl_site.verl_argv(role, out), verl_site.verl_env(args.verl_site))
        medians = alternating_medians({label: (argv, env) for label, argv, env in contenders.values()},
                                      out, args.repeat, f"{role}/model_*.pt")
        results[world] = {key: medians[label] for key, (label, _, _) in contenders.items()}
        if args.verl_site:
            ours_out, verl_out = args.work / "fair-ckptflow", args.work / "fair-verl"
            print("  same model as verl's? " + verl_site.compare_outputs([*ckptflow, str(ours_out)], ours_out,
                                                                         args.verl_site, role, verl_out))

    big, small = results[1024], results[256]
    print("\nratios (goals from issue 12 in brackets)")
    print(f"  ckptflow W=1024 / W=256: {big['ckptflow']['seconds'] / small['ckptflow']['seconds']:.2f}x whole process, "
          f"{big['ckptflow']['work_seconds'] / small['ckptflow']['work_seconds']:.2f}x after imports   [<= 4.5x]")
    baselines = ([] if args.skip_verl else [("verl", "verl-style")]) + ([("verl_real", verl_site.LABEL)] if args.verl_site else [])
    for name, label in baselines:
        print(f"  {label} W=1024 / W=256: {big[name]['seconds'] / small[name]['seconds']:.2f}x whole process")
        for world in WORLDS:
            r = results[world]
            print(f"  W={world}: ckptflow {r[name]['seconds'] / r['ckptflow']['seconds']:.2f}x faster than {label} "
                  f"whole process, {r[name]['work_seconds'] / r['ckptflow']['work_seconds']:.2f}x after imports"
                  + ("   [>= 2x]" if world == 1024 else ""))
    (args.work / "results-world.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
