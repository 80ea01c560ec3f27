"""The GPU path, end to end: merge a checkpoint in bf16 and fp32 and run the logits check on CUDA.

    python bench/gpu_check.py                       # writes a Qwen2-like FSDP2 checkpoint (hidden 1024, 8 layers)
    python bench/gpu_check.py --require-cuda        # on a GPU machine: refuse to fall back to the CPU
    python bench/gpu_check.py --checkpoint RUN/global_step_1/actor --reference RUN/reference
    python bench/gpu_check.py --engine vllm         # also the engine check of each merged folder in vLLM

On a machine where torch sees a GPU, the logits check runs there (`mergecore.proofs.verify.logits_device`); without
one the same steps run on the CPU and the first line says so. For each dtype it prints one result line,
`result dtype=bf16 device=cuda ok=True max_abs_diff=0 merge_s=... logits_s=...`, and ends with `gpu_check: ok`
(exit 0) or `gpu_check: FAILED` (exit 1). The merged weights equal the reference's cast to the same dtype, so the
two models' logits must agree to `--atol` (default 1e-5) on any device. With `--engine vllm` (the default where
torch sees a GPU and vLLM is installed for ckptflow: the CUDA worker image), each merged folder is also loaded in
vLLM and its logprobs compared with transformers' (`mergecore.serving`), one `engine ...` line per dtype.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing it

DTYPES = ("bf16", "fp32")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a verl FSDP role folder to merge (default: write a demo checkpoint)")
    parser.add_argument("--reference", help="its reference HF folder (default: RUN_ROOT/reference)")
    parser.add_argument("--work", help="folder for the written checkpoint and the merges (default: a temporary one)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU)")
    parser.add_argument("--require-cuda", action="store_true", help="fail unless torch sees a CUDA GPU")
    parser.add_argument("--hidden", type=int, default=1024, help="demo checkpoint: hidden size")
    parser.add_argument("--layers", type=int, default=8, help="demo checkpoint: decoder layers")
    parser.add_argument("--vocab", type=int, default=32000, help="demo checkpoint: vocabulary size")
    parser.add_argument("--world-size", type=int, default=2, help="demo checkpoint: FSDP2 ranks")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence in the logits check")
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--engine", choices=["vllm", "none"], help="engine check of each merged folder (default: "
                        "vllm where torch sees a GPU and it is installed, else none)")
    return parser.parse_args(argv)


def describe_device(args) -> str:
    """The device line; exits 2 when --require-cuda finds no GPU."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return f"device cuda ({name}, torch {torch.__version__}, CUDA {torch.version.cuda})"
    if args.require_cuda:
        print(f"gpu_check: error: --require-cuda but torch {torch.__version__} sees no CUDA GPU", file=sys.stderr)
        sys.exit(2)
    return f"device cpu (no CUDA GPU seen by torch {torch.__version__}: the same check runs on the CPU)"


def demo_checkpoint(args, work: Path) -> tuple[Path, Path]:
    """A real FSDP2 checkpoint of a Qwen2-like model of the requested size: (role folder, reference folder)."""
    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    heads = max(1, args.hidden // 64)
    spec = DemoSpec(world_size=args.world_size, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                    num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                    vocab_size=args.vocab)
    start = time.perf_counter()
    written = write_demo_checkpoint(work / "run", spec)
    print(f"gpu_check: wrote {written.role_dir} (qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"W={args.world_size}) in {time.perf_counter() - start:.1f} s")
    return Path(written.role_dir), Path(written.reference_dir)


def check_dtype(role: Path, reference: Path, out: Path, dtype: str, args) -> dict:
    """Merge to `dtype` (with its round-trip verification), then the logits check against the reference."""
    from mergecore import merge_checkpoint
    from mergecore.proofs.verify import compare_logits

    start = time.perf_counter()
    merge_checkpoint(str(role), out, dtype=dtype, overwrite=True)
    merged = time.perf_counter() - start
    start = time.perf_counter()
    try:
        logits = compare_logits(out, reference, atol=args.atol, seq_len=args.seq_len, device=args.device)
    except Exception as err:  # noqa: BLE001 - a failed check is a result line, not a traceback
        logits = {"device": args.device or "?", "ok": False, "max_abs_diff": float("nan"), "error": str(err)}
    return {"dtype": dtype, "device": logits["device"], "ok": logits["ok"], "max_abs_diff": logits["max_abs_diff"],
            "merge_s": merged, "logits_s": time.perf_counter() - start, "error": logits.get("error")}


def engine_wanted(args) -> bool:
    import torch

    from mergecore.serving.environment import installed

    if args.engine:
        return args.engine == "vllm"
    return torch.cuda.is_available() and (installed("vllm") is not None or bool(os.environ.get("CKPTFLOW_ENGINE_PYTHON")))


def check_engine(folder: Path, dtype: str) -> dict:
    """The engine check of one merged folder, as a result line (a failure or 'cannot run here' is a failed line)."""
    from mergecore.serving import engine_check

    start = time.perf_counter()
    try:
        row = engine_check(folder, "vllm")
    except Exception as err:  # noqa: BLE001 - a failed check is a result line, not a traceback
        row = {"device": "?", "ok": False, "max_abs_diff": float("nan"), "error": str(err)}
    return {"dtype": f"{dtype} engine=vllm", "device": row["device"], "ok": row["ok"],
            "max_abs_diff": row["max_abs_diff"], "merge_s": 0.0, "logits_s": time.perf_counter() - start,
            "error": row.get("error")}


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"gpu_check: {describe_device(args)}")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        work = Path(args.work or scratch)
        if args.checkpoint:
            role = Path(args.checkpoint)
            reference = Path(args.reference) if args.reference else role.parents[1] / "reference"
        else:
            role, reference = demo_checkpoint(args, work)
        results = [check_dtype(role, reference, work / f"merged-{dtype}", dtype, args) for dtype in DTYPES]
        if engine_wanted(args):
            results += [check_engine(work / f"merged-{dtype}", dtype) for dtype in DTYPES]
    for r in results:
        print(f"result dtype={r['dtype']} device={r['device']} ok={r['ok']} max_abs_diff={r['max_abs_diff']:.3g} "
              f"merge_s={r['merge_s']:.2f} logits_s={r['logits_s']:.2f}" + (f" error={r['error']}" if r["error"] else ""))
    ok = all(r["ok"] for r in results)
    print("gpu_check: ok" if ok else "gpu_check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
