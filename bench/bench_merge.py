"""Benchmark `ckptflow merge` against a naive full-load merger and `cp -r`, in one run.

    python bench/bench_merge.py            # ~2.3 GB fp32 checkpoint (10 layers) and a 20-layer one

Writes real FSDP2 checkpoints (W=4, Qwen2-like: hidden 2048, intermediate 5632, 16 heads / 4 kv
heads, vocab 32000) under bench/_work (kept between runs), warms the page cache, then times each
contender `--repeat` times and prints medians and ratios. Baselines: a lean full-load merger
(load every rank, concatenate, cast, one save_file) and the shape of verl's merger (the same, then
transformers' save_pretrained and the tokenizer copy). Memory is the peak anonymous (private)
RSS of the whole process, start-up included; total RSS is shown beside it. On the 10-layer checkpoint the
contenders alternate (one sample of each per round), so the machine's slow stretches fall on all alike.

    python bench/bench_merge.py --verl-site bench/_work/verl-site   # adds verl's real merger (0.9.1)

`--verl-site` is a folder holding verl 0.9.1 and the few packages its merger imports, installed with
`pip install --no-deps --target` (never into the project's env): see bench/verl_site.py. Its output is
compared with ours tensor by tensor before the timings are trusted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import verl_site
from measure import alternating_medians, median_run, warm

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def bench_spec(layers: int):
    from ckptflow_testing.demo_checkpoint import DemoSpec

    return DemoSpec(arch="qwen2", mode="fsdp2", world_size=4, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)


def checkpoint(work: Path, layers: int) -> Path:
    from ckptflow_testing.demo_checkpoint import write_demo_checkpoint

    root = work / f"ckpt-{layers}-layers"
    role = root / "global_step_1" / "actor"
    if not (role / "model_world_size_4_rank_3.pt").exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"writing the {layers}-layer checkpoint with real FSDP (once; kept in {work})...", flush=True)
        write_demo_checkpoint(root, bench_spec(layers))
        shutil.rmtree(root / "reference")  # not needed here; saves disk
        for optim in role.glob("optim_*.pt"):
            optim.unlink()
    return role


def run(label: str, argv: list[str], out: Path, repeat: int, role: Path) -> dict:
    return median_run(label, argv, out, repeat, f"{role}/model_*.pt")


def merge_phase_seconds(role: Path, out: Path, extra: list[str], repeat: int) -> float:
    """The merge itself (plan + write), as the manifest records it, without start-up or verification."""
    seconds = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        warm(f"{role}/model_*.pt")
        subprocess.run([PYTHON, "-m", "flows.cli", "merge", "--local_dir", str(role), "--target_dir", str(out), *extra],
                       check=True, capture_output=True)
        timings = json.loads((out / "ckptflow_manifest.json").read_text())["timings"]
        seconds.append(timings["merge"])
    shutil.rmtree(out, ignore_errors=True)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--depths", default="10,20", help="layer counts to write and time (10 is the reference)")
    parser.add_argument("--verl-site", type=Path, help="folder with verl 0.9.1 installed (bench/verl_site.py)")
    args = parser.parse_args()
    if args.verl_site:
        verl_site.check_site(args.verl_site)
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "out"
    ckptflow = [PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--dtype", "bf16", "--target_dir", str(out), "--local_dir"]

    results = {}
    for layers in sorted({10, *map(int, args.depths.split(","))}):
        role = checkpoint(args.work, layers)
        size = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e9
        warm(f"{role}/model_*.pt")
        print(f"\n{layers} layers: {size:.2f} GB of fp32 rank files (W=4), medians of {args.repeat}")
        if layers == 10:
            contenders = {
                "ckptflow": ("ckptflow merge (verified)", [*ckptflow, str(role)]),
                "ckptflow_noverify": ("ckptflow merge --skip-verify", [*ckptflow, str(role), "--skip-verify"]),
                "naive": ("naive full-load merge", [PYTHON, str(HERE / "naive_merge.py"), str(role), str(out)]),
                "verl": ("verl-style (save_pretrained)", [PYTHON, str(HERE / "verl_style_merge.py"), str(role), str(out)]),
                "cp": ("cp -r + sync", ["bash", "-c", f"cp -r {role} {out} && sync"]),
            }
            envs = dict.fromkeys(contenders)
            if args.verl_site:
                contenders["verl_real"] = (verl_site.LABEL, verl_site.verl_argv(role, out))
                envs["verl_real"] = verl_site.verl_env(args.verl_site)
            medians = alternating_medians({label: (argv, envs[key]) for key, (label, argv) in contenders.items()},
                                          out, args.repeat, f"{role}/model_*.pt")
            results[layers] = {key: medians[label] for key, (label, _) in contenders.items()}
            results[layers]["merge_phase"] = merge_phase_seconds(role, out, ["--dtype", "bf16", "--skip-verify"], args.repeat)
            print(f"  {'merge phase alone':<28} {results[layers]['merge_phase']:7.2f} s")
            if args.verl_site:
                ours_out, verl_out = args.work / "fair-ckptflow", args.work / "fair-verl"
                ours_argv = [*ckptflow[:-2], str(ours_out), "--local_dir", str(role)]
                print("  same model as verl's? " + verl_site.compare_outputs(ours_argv, ours_out, args.verl_site, role, verl_out))
        else:
            results[layers] = {
                "ckptflow": run("ckptflow merge (verified)", [*ckptflow, str(role)], out, args.repeat, role),
                "ckptflow_noverify": run("ckptflow merge --skip-verify", [*ckptflow, str(role), "--skip-verify"], out, args.repeat, role),
            }

    ours, fast, cp = results[10]["ckptflow"], results[10]["ckptflow_noverify"], results[10]["cp"]
    print("\nratios (10 layers; targets from the issue in brackets)")
    baselines = [("verl", "verl-style merger"), ("naive", "lean full-load merger")]
    if args.verl_site:
        baselines.insert(0, ("verl_real", verl_site.LABEL))
    for name, label in baselines:
        base = results[10][name]
        print(f"  vs {label}: speed-up {base['seconds'] / ours['seconds']:.2f}x whole process, "
              f"{base['work_seconds'] / ours['work_seconds']:.2f}x after imports "
              f"({base['work_seconds'] / fast['work_seconds']:.2f}x --skip-verify) [>= 3x]; "
              f"peak private memory {ours['anon_mib'] / base['anon_mib']:.3f} [<= 0.2]")
    print(f"  merge phase vs cp -r:                 {results[10]['merge_phase'] / cp['seconds']:5.2f}x   [<= 1.5x]")
    if 20 in results:
        print(f"  peak private memory, 20 vs 10 layers: {results[20]['ckptflow']['anon_mib'] / ours['anon_mib']:5.2f}x   [flat = 1.0]")
    (args.work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
