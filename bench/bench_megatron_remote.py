"""Megatron checkpoints on a local moto S3 server: bytes a merge fetches, against the files' size.

Two checkpoints of the same tiny Llama (`ckptflow_testing` fixture writers): legacy TP=2 `model.pt` files
that also hold Adam state (two fp32 tensors per parameter, Megatron-LM's `{"model", "optimizer"}` layout), and
a dist_ckpt folder whose `.distcp` file holds an optimizer box. Bytes are counted at s3fs's boundary
(`_cat_file`: every ranged GET; `_get_file`: whole downloads) during a full merge, whole-file copy as the
baseline. The merge also runs in a fresh process per repeat: wall time, medians (moto on the same cores).

    PYTHONPATH=. python bench/bench_megatron_remote.py --repeat 3
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

MERGE = "import sys; from mergecore import merge_checkpoint; merge_checkpoint(sys.argv[1], sys.argv[2], dtype='bf16')"


def legacy_checkpoint(root: Path) -> Path:
    import torch

    from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint

    ckpt = write_megatron_checkpoint(root / "legacy", "llama", tp=2, style="megatron-lm")
    for path in (ckpt.role_dir / "model").glob("mp_rank_*/model.pt"):
        saved = torch.load(path, weights_only=False)
        params = [t for t in saved["model"].values() if isinstance(t, torch.Tensor)]
        saved["optimizer"] = {"state": {i: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
                                        for i, t in enumerate(params)}}
        torch.save(saved, path)
    return ckpt.role_dir


def dist_checkpoint(root: Path) -> Path:
    from ckptflow.testing.megatron_dist_fixtures import write_dist_checkpoint

    return write_dist_checkpoint(root / "dist", "llama").role_dir


def counting():
    import s3fs

    fetched, whole = collections.Counter(), collections.Counter()
    ranged, downloaded = s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file

    async def cat_file(self, path, version_id=None, start=None, end=None):
        data = await ranged(self, path, version_id=version_id, start=start, end=end)
        fetched[path.split("://")[-1]] += len(data)
        return data

    async def get_file(self, rpath, lpath, **kwargs):
        result = await downloaded(self, rpath, lpath, **kwargs)
        whole[rpath.split("://")[-1]] += os.path.getsize(lpath)
        return result

    s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file = cat_file, get_file
    s3fs.S3FileSystem.clear_instance_cache()
    return fetched, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import s3fs

    from mergecore import merge_checkpoint

    server, _ = start_moto()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        os.environ["CKPTFLOW_CACHE"] = str(root / "cache")
        fs = s3fs.S3FileSystem(endpoint_url=os.environ["FSSPEC_S3_ENDPOINT_URL"])
        fs.mkdir("bench-mremote")
        fetched, whole = counting()
        for kind, role in (("legacy TP2 model.pt", legacy_checkpoint(root)), ("dist_ckpt .distcp", dist_checkpoint(root))):
            url = f"bench-mremote/{role.parent.parent.name}/actor"
            fs.put(str(role), url, recursive=True)
            data = [p for p in role.rglob("*") if p.name == "model.pt" or p.suffix == ".distcp"]
            sizes = {f"{url}/{p.relative_to(role).as_posix()}": p.stat().st_size for p in data}
            fetched.clear(), whole.clear()
            merge_checkpoint(f"s3://{url}", root / f"out-{role.parent.parent.name}", dtype="bf16")
            got = sum(fetched[k] for k in sizes)
            downloaded = sum(whole[k] for k in sizes)
            times = [measure([sys.executable, "-c", MERGE, f"s3://{url}", str(root / f"t-{i}-{kind[:4]}")])["seconds"]
                     for i in range(args.repeat)]
            print(f"{kind}: {len(sizes)} files, {sum(sizes.values()) / 2**20:.2f} MiB; a merge fetched "
                  f"{got / 2**20:.2f} MiB by range ({got / sum(sizes.values()):.1%}), {downloaded} bytes whole; "
                  f"merge wall {statistics.median(times):.2f} s (median of {args.repeat}, whole process)")
    server.stop()


if __name__ == "__main__":
    main()
