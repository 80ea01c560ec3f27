"""Object storage in and out, on a local moto S3 server: bytes fetched and whole-process time.

A real FSDP2 checkpoint (W=4, model + optimizer + extra-state files) is uploaded to moto. Measured in one run:
- bytes fetched from the model rank files by a full merge (range reads) and by a merge of one layer group,
  against the model files' size, and bytes from the optimizer files (must be 0);
- wall time, whole process, medians of --repeat: `ckptflow merge s3:// -> s3://` (range reads, upload
  manifest last) vs the old way's shape (copy the model rank files whole, merge locally, upload the folder).

    PYTHONPATH=. python bench/bench_remote.py --repeat 3
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import measure  # noqa: E402
from moto_s3 import start_moto  # noqa: E402

BASELINE = """
import sys, s3fs, tempfile, os
from mergecore import merge_checkpoint
fs, root = s3fs.S3FileSystem(), sys.argv[1].split("://")[-1]
with tempfile.TemporaryDirectory() as scratch:
    for path in fs.find(root):
        name = path.rsplit("/", 1)[1]
        if name.startswith("model_world_size_") or "/huggingface/" in path or name == "fsdp_config.json":
            local = os.path.join(scratch, "actor", os.path.relpath(path, root))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get_file(path, local)
    merge_checkpoint(os.path.join(scratch, "actor"), os.path.join(scratch, "out"), dtype="bf16")
    fs.put(os.path.join(scratch, "out"), sys.argv[2], recursive=True)
"""


def counted_bytes(source: str, group_only: bool) -> collections.Counter:
    """Bytes s3fs returned per object while merging `source` (all of it, or its second group)."""
    import s3fs

    fetched = collections.Counter()
    ranged = s3fs.S3FileSystem._cat_file

    async def cat_file(self, path, version_id=None, start=None, end=None):
        data = await ranged(self, path, version_id=version_id, start=start, end=end)
        fetched[path.split("://")[-1].rsplit("/", 1)[1]] += len(data)
        return data

    s3fs.S3FileSystem._cat_file = cat_file
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        from mergecore import merge_group, prepare
        from mergecore.engine.writer import prepare_files

        prepared = prepare(source, dtype="bf16")
        with tempfile.TemporaryDirectory() as scratch:
            prepare_files(prepared.plan, Path(scratch))
            for group in prepared.plan.groups[1:2] if group_only else prepared.plan.groups:
                merge_group(prepared.source, prepared.plan, group, Path(scratch))
    finally:
        s3fs.S3FileSystem._cat_file = ranged
    return fetched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    server, env = start_moto()
    import s3fs

    fs = s3fs.S3FileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        env["CKPTFLOW_CACHE"] = os.environ["CKPTFLOW_CACHE"] = str(Path(scratch) / "cache")
        ckpt = write_demo_checkpoint(Path(scratch) / "ckpt", DemoSpec(
            world_size=4, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
            vocab_size=8000, num_attention_heads=8, num_key_value_heads=4))
        fs.mkdir("bench-ckpts")
        fs.mkdir("bench-models")
        fs.put(str(ckpt.role_dir), "bench-ckpts/run/global_step_1/actor", recursive=True)
        source = "s3://bench-ckpts/run/global_step_1/actor"
        sizes = {p.name: p.stat().st_size for p in ckpt.role_dir.iterdir() if p.is_file()}
        model_bytes = sum(v for k, v in sizes.items() if k.startswith("model_"))
        optim_bytes = sum(v for k, v in sizes.items() if k.startswith(("optim_", "extra_state_")))

        full, one = counted_bytes(source, False), counted_bytes(source, True)
        print(f"model rank files {model_bytes / 1e6:.1f} MB, optimizer+extra {optim_bytes / 1e6:.1f} MB")
        for label, counts in (("full merge", full), ("one group", one)):
            got = sum(v for k, v in counts.items() if k.startswith("model_"))
            print(f"{label}: fetched {got / 1e6:.2f} MB of model files ({got / model_bytes:.2f}x), "
                  f"optimizer bytes {sum(v for k, v in counts.items() if k.startswith(('optim_', 'extra_state_')))}")

        runs = {"range reads -> s3 (ckptflow)": [], "whole copies + local merge + upload": []}
        for i in range(args.repeat):
            cli = [sys.executable, "-m", "ckptflow.flows.cli", "merge", "--local_dir", source, "--target_dir",
                   f"s3://bench-models/range-{i}", "--dtype", "bf16"]
            runs["range reads -> s3 (ckptflow)"].append(measure(cli, env))
            base = [sys.executable, "-c", BASELINE, source, f"bench-models/whole-{i}"]
            runs["whole copies + local merge + upload"].append(measure(base, env))
        for label, samples in runs.items():
            print(f"{label}: {statistics.median(s['seconds'] for s in samples):.2f} s, "
                  f"peak private {statistics.median(s['anon_mib'] for s in samples):.0f} MiB")
        ours, theirs = (statistics.median(s["seconds"] for s in v) for v in runs.values())
        print(f"ratio whole-copy / range-read: {theirs / ours:.2f}x")
    server.stop()


if __name__ == "__main__":
    main()
