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

The CRC-32 check of the rank files' zip members (on by default) is timed against the same merge with
`CKPTFLOW_CHECK_CRC=0`, alternating, whole process and merge phase alone:

    python bench/bench_merge.py --depths 10 --repeat 5 --contenders ckptflow,ckptflow_nocrc
"""

from __future__ import annotations

import argparse
import json
import os
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
    from ckptflow.testing.demo_checkpoint import DemoSpec

    return DemoSpec(arch="qwen2", mode="fsdp2", world_size=4, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)


def checkpoint(work: Path, layers: int) -> Path:
    from ckptflow.testing.demo_checkpoint import write_demo_checkpoint

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
    return statistics.median(merge_phase_samples(role, out, extra, repeat))


def merge_phase_samples(role: Path, out: Path, extra: list[str], repeat: int, env: dict | None = None) -> list[float]:
    seconds = []
    for _ in range(repeat):
        seconds.append(one_merge_phase(role, out, extra, env))
    return seconds


def one_merge_phase(role: Path, out: Path, extra: list[str], env: dict | None = None) -> float:
    shutil.rmtree(out, ignore_errors=True)
    warm(f"{role}/model_*.pt")
    subprocess.run([PYTHON, "-m", "ckptflow.flows.cli", "merge", "--local_dir", str(role), "--target_dir", str(out), *extra],
                   check=True, capture_output=True, env=env)
    seconds = json.loads((out / "ckptflow_manifest.json").read_text())["timings"]["merge"]
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def crc_phase_ratio(role: Path, out: Path, repeat: int) -> dict:
    """Merge phase with the CRC-32 check on and off, alternating (one of each per round): medians and the
    median of the per-round ratios, so a slow stretch of the machine falls on both alike."""
    extra = ["--dtype", "bf16", "--skip-verify"]
    on, off = [], []
    for _ in range(repeat):
        on.append(one_merge_phase(role, out, extra))
        off.append(one_merge_phase(role, out, extra, CRC_OFF))
    return {"on": statistics.median(on), "off": statistics.median(off),
            "pair_ratio": statistics.median(a / b for a, b in zip(on, off))}


CRC_OFF = {**os.environ, "CKPTFLOW_CHECK_CRC": "0"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--depths", default="10,20", help="layer counts to write and time (10 is the reference)")
    parser.add_argument("--verl-site", type=Path, help="folder with verl 0.9.1 installed (bench/verl_site.py)")
    parser.add_argument("--contenders", help="comma-separated keys to time on the 10-layer checkpoint (default: all)")
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
                "ckptflow_nocrc": ("ckptflow merge, CRC-32 check off", [*ckptflow, str(role)]),
                "naive": ("naive full-load merge", [PYTHON, str(HERE / "naive_merge.py"), str(role), str(out)]),
                "verl": ("verl-style (save_pretrained)", [PYTHON, str(HERE / "verl_style_merge.py"), str(role), str(out)]),
                "cp": ("cp -r + sync", ["bash", "-c", f"cp -r {role} {out} && sync"]),
            }
            envs = {**dict.fromkeys(contenders), "ckptflow_nocrc": CRC_OFF}
            if args.verl_site:
                contenders["verl_real"] = (verl_site.LABEL, verl_site.verl_argv(role, out))
                envs["verl_real"] = verl_site.verl_env(args.verl_site)
            if args.contenders:
                contenders = {key: contenders[key] for key in args.contenders.split(",")}
            medians = alternating_medians({label: (argv, envs[key]) for key, (label, argv) in contenders.items()},
                                          out, args.repeat, f"{role}/model_*.pt")
            results[layers] = {key: medians[label] for key, (label, _) in contenders.items()}
            results[layers]["merge_phase"] = merge_phase_seconds(role, out, ["--dtype", "bf16", "--skip-verify"], args.repeat)
            print(f"  {'merge phase alone':<28} {results[layers]['merge_phase']:7.2f} s")
            crc = results[layers]["crc_merge_phase"] = crc_phase_ratio(role, out, args.repeat)
            print(f"  {'merge phase, CRC on / off':<28} {crc['on']:7.2f} s / {crc['off']:.2f} s "
                  f"(median pair ratio {crc['pair_ratio']:.3f})")
            if args.verl_site:
                ours_out, verl_out = args.work / "fair-ckptflow", args.work / "fair-verl"
                ours_argv = [*ckptflow[:-2], str(ours_out), "--local_dir", str(role)]
                print("  same model as verl's? " + verl_site.compare_outputs(ours_argv, ours_out, args.verl_site, role, verl_out))
        else:
            results[layers] = {
                "ckptflow": run("ckptflow merge (verified)", [*ckptflow, str(role)], out, args.repeat, role),
                "ckptflow_noverify": run("ckptflow merge --skip-verify", [*ckptflow, str(role), "--skip-verify"], out, args.repeat, role),
            }

    ours = results[10]["ckptflow"]
    print("\nratios (10 layers; targets from the issue in brackets)")
    if "ckptflow_nocrc" in results[10]:
        off = results[10]["ckptflow_nocrc"]
        print(f"  CRC-32 check on / off, whole process: {ours['seconds'] / off['seconds']:.3f}x "
              f"({ours['work_seconds'] / off['work_seconds']:.3f}x after imports)")
    if not {"ckptflow_noverify", "cp"} <= set(results[10]):
        (args.work / "results.json").write_text(json.dumps(results, indent=2))
        return
    fast, cp = results[10]["ckptflow_noverify"], results[10]["cp"]
    baselines = [(name, label) for name, label in [("verl", "verl-style merger"), ("naive", "lean full-load merger")]
                 if name in results[10]]
    if args.verl_site and "verl_real" in results[10]:
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
