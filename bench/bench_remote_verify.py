"""`ckptflow verify s3://...` on a local moto S3 server: peak local disk and whole-process time.

A real FSDP2 checkpoint (W=2) is merged to moto in several weight files (`--shards`). Measured in one run,
whole processes, medians of --repeat, alternating:
- `ckptflow verify s3://...` (ranged reads, one weight file at a time, round trip against the local checkpoint);
- the old way's shape: copy every file the manifest lists to a temporary folder (`RemoteTarget.local_copy`),
  then the local folder's checks (`flows.cli.verify_folder`).
Peak local disk: the files in the run's scratch folder (temporary copies) plus the unlinked files the process
still holds there (range files), sampled every few ms from /proc.

    PYTHONPATH=. python bench/bench_remote_verify.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import _status_kib  # noqa: E402
from moto_s3 import start_moto  # noqa: E402

OLD_WAY = """
import sys
from ckptflow.flows.cli import verify_folder
from mergecore import open_target
with open_target(sys.argv[1]).local_copy() as folder:
    print([r["check"] for r in verify_folder(folder, False, None, None)])
"""


def local_bytes(folder: Path, pid: int) -> int:
    """Bytes allocated under `folder`: its files, and the unlinked ones process `pid` holds open there."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith(f"{folder}/") and link.endswith(" (deleted)"):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
    except OSError:  # the process ended or closed it meanwhile
        pass
    return total


def measure_disk(argv: list[str], env: dict, scratch: Path) -> dict:
    scratch.mkdir(parents=True)
    env = {**env, "TMPDIR": str(scratch), "CKPTFLOW_CACHE": str(scratch / "cache")}
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        peak_disk = peak_anon = 0
        while proc.poll() is None:
            peak_disk = max(peak_disk, local_bytes(scratch, proc.pid))
            try:
                peak_anon = max(peak_anon, _status_kib(proc.pid)[0])
            except (FileNotFoundError, ProcessLookupError):
                pass
            time.sleep(0.003)
        seconds = time.perf_counter() - started
        out.seek(0)
        if proc.wait():
            raise RuntimeError(f"{argv[:4]} failed: {out.read().decode()[-2000:]}")
    shutil.rmtree(scratch)
    return {"seconds": seconds, "disk_mb": peak_disk / 1e6, "anon_mib": peak_anon / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shards", type=int, default=8, help="about this many weight files")
    args = parser.parse_args()

    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    server, env = start_moto()
    import s3fs

    from mergecore import merge_checkpoint

    fs = s3fs.S3FileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["CKPTFLOW_CACHE"] = str(Path(scratch) / "cache")
        ckpt = write_demo_checkpoint(Path(scratch) / "ckpt", DemoSpec(
            world_size=2, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
            vocab_size=8000, num_attention_heads=8, num_key_value_heads=4))
        model_bytes = sum(p.stat().st_size for p in ckpt.role_dir.glob("model_world_size_*"))
        fs.mkdir("bench-models")
        url = "s3://bench-models/verify"
        merge_checkpoint(str(ckpt.role_dir), url, max_shard_size=model_bytes // args.shards)
        weights = [fs.size(p) for p in fs.find(url[5:]) if p.endswith(".safetensors")]
        print(f"model {sum(weights) / 1e6:.1f} MB in {len(weights)} weight files, largest {max(weights) / 1e6:.1f} MB")

        runs = {"ranged reads, file by file (ckptflow verify)": [], "whole copy, then local checks (before)": []}
        for i in range(args.repeat):
            for label, argv in zip(runs, ([sys.executable, "-m", "ckptflow.flows.cli", "verify", url],
                                          [sys.executable, "-c", OLD_WAY, url])):
                runs[label].append(measure_disk(argv, env, Path(scratch) / f"run-{len(runs[label])}-{i}-{label[:5]}"))
        for label, samples in runs.items():
            print(f"{label}: {statistics.median(s['seconds'] for s in samples):.2f} s, peak local disk "
                  f"{statistics.median(s['disk_mb'] for s in samples):.1f} MB, peak private "
                  f"{statistics.median(s['anon_mib'] for s in samples):.0f} MiB")
        ours, before = runs.values()
        median = lambda samples, key: statistics.median(s[key] for s in samples)  # noqa: E731
        print(f"time ratio new/old: {median(ours, 'seconds') / median(before, 'seconds'):.2f}x; "
              f"peak local disk ratio new/old: {median(ours, 'disk_mb') / median(before, 'disk_mb'):.2f}x")
    server.stop()


if __name__ == "__main__":
    main()
