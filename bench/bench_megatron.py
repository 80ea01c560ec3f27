"""Benchmark merging a Megatron dist_ckpt against `dcp_to_torch_save` + a full load, in one run.

    python bench/bench_megatron.py      # writes a ~2.1 GB fp32 dist_ckpt under bench/_work once
    python bench/bench_megatron.py --vs-fsdp   # also: the FSDP merge of the same model (bench_merge's checkpoint)

The checkpoint is the bench's Qwen2-like model (hidden 2048, intermediate 5632, 10 layers, 16/4 heads,
vocab 32000), random weights, as Megatron's global tensors (fused QKV per query group, [gate; up],
stacked layer axis) saved by torch DCP in verl 0.9.1's layout, like megatron-core's torch_dist backend
writes (the tests check the reader on folders saved by megatron-core itself). Whole processes, start-up
included, medians of --repeat; memory is the peak anonymous RSS, total RSS beside it.
With --vs-fsdp the same merge of bench_merge.py's 10-layer FSDP2 checkpoint (the same model, W=4) runs too,
and the ratio Megatron / FSDP is printed (goal <= 1.3x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from measure import median_run

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=10, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


def checkpoint(work: Path) -> Path:
    """role folder of the bench dist_ckpt (written once)."""
    role = work / "mcore-10-layers" / "global_step_1" / "actor"
    if (role / "model" / "dist_ckpt" / ".metadata").exists():
        return role
    print("writing the dist_ckpt (once; kept in bench/_work)...", flush=True)
    import json

    import torch
    import transformers

    from ckptflow.testing.megatron_dist_fixtures import save_dist, to_dist_state
    from ckptflow.testing.megatron_fixtures import reshard

    config = transformers.Qwen2Config(**CONFIG)
    torch.manual_seed(0)
    state = transformers.Qwen2ForCausalLM(config).float().state_dict()
    legacy = reshard(state, config.to_dict(), tp=1)[(0, 0)][0]
    del state
    save_dist(to_dist_state(legacy, CONFIG["num_hidden_layers"]), role / "model" / "dist_ckpt")
    hf = role / "model" / "huggingface"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}, indent=2))
    return role


def run(label: str, argv: list[str], out: Path, repeat: int, role: Path) -> dict:
    return median_run(label, argv, out, repeat, f"{role}/model/dist_ckpt/*.distcp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vs-fsdp", action="store_true", help="also merge bench_merge's FSDP checkpoint of this model")
    args = parser.parse_args()
    role = checkpoint(args.work)
    out = args.work / "mcore-out"
    size = sum(f.stat().st_size for f in (role / "model" / "dist_ckpt").glob("*.distcp")) / 1e9
    print(f"\n{size:.2f} GB dist_ckpt (fp32), medians of {args.repeat}")
    ours = run("ckptflow merge (bf16, verified)", [PYTHON, "-m", "ckptflow.flows.cli", "merge", "--backend", "megatron_dist",
                                                   "--local_dir", str(role), "--target_dir", str(out), "--dtype", "bf16"],
               out, args.repeat, role)
    base = run("dcp_to_torch_save + full load", [PYTHON, str(HERE / "dcp_full_load.py"), str(role / "model" / "dist_ckpt"),
                                                 str(out)], out, args.repeat, role)
    print(f"\n  speed-up {base['seconds'] / ours['seconds']:.2f}x; peak private memory "
          f"{ours['anon_mib'] / base['anon_mib']:.3f}x; peak RSS {ours['rss_mib'] / base['rss_mib']:.3f}x")
    if args.vs_fsdp:
        import bench_merge

        fsdp_role = bench_merge.checkpoint(args.work, CONFIG["num_hidden_layers"])
        fsdp_bytes = sum(f.stat().st_size for f in fsdp_role.glob("model_*.pt")) / 1e9
        fsdp = run_fsdp(fsdp_role, out, args.repeat)
        print(f"\n  FSDP merge of the same model ({fsdp_bytes:.2f} GB, W=4): Megatron / FSDP "
              f"{ours['seconds'] / fsdp['seconds']:.2f}x time (goal <= 1.3x), {ours['anon_mib'] / fsdp['anon_mib']:.2f}x "
              "peak private memory")


def run_fsdp(role: Path, out: Path, repeat: int) -> dict:
    argv = [PYTHON, "-m", "ckptflow.flows.cli", "merge", "--backend", "fsdp", "--local_dir", str(role), "--target_dir", str(out),
            "--dtype", "bf16"]
    return median_run("ckptflow merge, FSDP (bf16, verified)", argv, out, repeat, f"{role}/model_*.pt")


if __name__ == "__main__":
    main()
