"""Peak private memory of `ckptflow merge` on a checkpoint whose largest tensor is 1.25 GB, with and without
the row-block budget, in one run.

    python bench/bench_memory.py [--repeat 3]
    python bench/bench_memory.py --loaded --repeat 5   # bf16 only: quiet, then beside a CPU hog and a disk hog,
                                                       # each sample a first merge (empty config cache)

The checkpoint: a one-layer Qwen2 shape with vocab 152064 x hidden 2048 (tied embedding: 1.25 GB fp32),
saved as verl's FSDP2 rank files (W=4, DTensor Shard(0)), written in one process with torch's fake process
group (real DTensor pickles, no training). Each merge is a whole process (`bench/ckptflow_merge.py`,
verification on); memory is the peak anonymous (private) RSS of it and its child processes together, start-up
included. "whole" is
CKPTFLOW_CHUNK_BYTES=0 (every tensor assembled whole, as before the budget), "budget" the default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from measure import median_run

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
WORLD = 4


def write_checkpoint(role: Path) -> None:
    """verl FSDP2 rank files of a random one-layer Qwen2 with a 152064 x 2048 tied embedding."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=152064, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                         torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Qwen2ForCausalLM(config).state_dict().items()
                  if name != "lm_head.weight"}
    generator = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    role.mkdir(parents=True, exist_ok=True)
    for rank in range(WORLD):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        state = {name: DTensor.from_local(torch.chunk(value, WORLD)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                          shape=value.shape, stride=value.stride())
                 for name, value in full.items()}
        torch.save(state, role / f"model_world_size_{WORLD}_rank_{rank}.pt")
        dist.destroy_process_group()
    (role / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}))
    config.save_pretrained(role / "huggingface")


def run(label: str, role: Path, out: Path, dtype: str, budget: str, repeat: int, config_cache: Path | None = None) -> dict:
    """`config_cache`: an empty CKPTFLOW_CONFIG_CACHE for this sample (a machine's first merge of the config: the
    config check builds the model, importing torch and transformers); None keeps the user's warm one."""
    env = {**os.environ, "CKPTFLOW_CHUNK_BYTES": budget, "PYTHONPATH": str(HERE.parent)}
    if config_cache is not None:
        shutil.rmtree(config_cache, ignore_errors=True)
        env["CKPTFLOW_CONFIG_CACHE"] = str(config_cache)
    argv = [PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--local_dir", str(role), "--target_dir", str(out),
            "--dtype", dtype]
    return median_run(label, argv, out, repeat, f"{role}/model_*.pt", env)


@contextmanager
def competing(work: Path):
    """A CPU-bound and a disk-bound process running beside the merge (a loaded machine), stopped on the way out."""
    scratch = work / "disk-hog.bin"
    hogs = [subprocess.Popen([PYTHON, "-c", "while True: pass"]),
            subprocess.Popen(["bash", "-c", f"while true; do dd if=/dev/zero of={scratch} bs=1M count=256 "
                                            "conv=fsync status=none; done"])]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        scratch.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loaded", action="store_true",
                        help="only the bf16 budget merge, --repeat times quiet and --repeat times beside a CPU hog "
                             "and a disk hog, each with an empty config cache; prints every sample's peak (the goal "
                             "holds for the largest)")
    args = parser.parse_args()
    role = args.work / "vocab152064" / "global_step_1" / "actor"
    if not (role / "huggingface" / "config.json").exists():
        print(f"writing the checkpoint (once; kept in {role})...", flush=True)
        shutil.rmtree(role, ignore_errors=True)
        write_checkpoint(role)
    out = args.work / "out-memory"
    if args.loaded:
        cold = args.work / "config-cache-cold"
        quiet = [run("bf16 budget, quiet", role, out, "bf16", "64MiB", 1, cold) for _ in range(args.repeat)]
        with competing(args.work):
            loaded = [run("bf16 budget, CPU + disk hogs", role, out, "bf16", "64MiB", 1, cold)
                      for _ in range(args.repeat)]
        for label, samples in (("quiet", quiet), ("loaded", loaded)):
            peaks = [sample["anon_mib"] for sample in samples]
            print(f"  {label}: peak private {', '.join(f'{p:.0f}' for p in peaks)} MiB (largest {max(peaks):.0f}) "
                  f"[<= 300 MiB]")
        return
    print(f"vocab 152064 x 2048, W={WORLD}, medians of {args.repeat} (whole process, verification on)")
    results = {}
    for dtype in ("fp32", "bf16"):
        whole = run(f"{dtype} whole tensors", role, out, dtype, "0", args.repeat)
        budget = run(f"{dtype} budget (default)", role, out, dtype, "64MiB", args.repeat)
        results[dtype] = {"whole": whole, "budget": budget}
        print(f"  {dtype}: peak private {budget['anon_mib']:.0f} MiB vs {whole['anon_mib']:.0f} MiB "
              f"({budget['anon_mib'] / whole['anon_mib']:.2f}x) [<= 300 MiB]; time {budget['seconds'] / whole['seconds']:.2f}x")
    (args.work / "results_memory.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
