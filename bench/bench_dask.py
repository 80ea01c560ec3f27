"""1 vs 2 Dask workers: whole `ckptflow promote --task-runner dask` processes, object storage in and out.

    python bench/bench_dask.py [--work bench/_work] [--repeat 3]           # s3:// -> s3:// on moto (default)
    python bench/bench_dask.py --local [--repeat 3]                         # local files -> local folder

Both modes use bench_merge.py's 2-layer checkpoint and a Prefect server started here (start-up excluded);
N=1 and N=2 alternate, each run into a fresh target (no cached file or group).

Object storage (default): a moto S3 server in its own process holds the checkpoint (uploaded once). Each
sample starts a LocalCluster of N worker processes (one thread each; its start is timed apart, not in the
sample), turns on per-process byte counting in its workers (`ckptflow_testing/s3_reads.py`, at s3fs's
boundary), then times `ckptflow promote s3://... --target s3://<fresh> --task-runner dask --dask-address
<it>` with a `--max-shard-size` that cuts the model into several files per worker. Reported: medians, the
throughput ratio N=1/N=2, and per worker the rank-file bytes it read and the output bytes it read back
(what it wrote and checked) as shares of the model; every run's weight files must have the same sha256s.
On N machines, each with its own network path to the store, the file-writing phase is bound by the
largest worker share; moto on 2 shared cores is one Python process, not S3, so the times here say little.

Local files (`--local`): `--dask-workers N` (cluster start inside the sample), shares from merge_group's
log lines (group -> worker pid) and the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_flow import start_server  # noqa: E402
from bench_merge import checkpoint  # noqa: E402
from measure import measure  # noqa: E402

MERGED_BY = re.compile(r"group (\S+) merged by process (\d+)")
SOURCE_PREFIX = "bench-ckpts/run/global_step_1/actor"
TARGET_BUCKET = "bench-models"


def local_promote_argv(role: Path, target: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "ckptflow.flows.cli", "promote", str(role), "--target", str(target), "--dtype", "bf16",
            "--task-runner", "dask", "--dask-workers", str(workers)]


def s3_promote_argv(source: str, target: str, scheduler: str, max_shard_size: str) -> list[str]:
    return [sys.executable, "-m", "ckptflow.flows.cli", "promote", source, "--target", target, "--dtype", "bf16",
            "--max-shard-size", max_shard_size, "--task-runner", "dask", "--dask-address", scheduler]


def worker_shares(api_url: str, since: datetime, group_bytes: dict[str, int]) -> list[float]:
    """Each worker's fraction of the model's bytes, largest first, from the run's merge_group log lines."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)))
    by_worker: Counter = Counter()
    for match in filter(None, (MERGED_BY.search(log.message) for log in logs)):
        by_worker[match[2]] += group_bytes[match[1]]
    total = sum(group_bytes.values())
    return sorted((b / total for b in by_worker.values()), reverse=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 in a process of its own, so its request handling does not share the bench's GIL."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(120):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise RuntimeError("moto_server did not start")


def weight_sha256s(fs, target: str) -> dict[str, str]:
    manifest = json.loads(fs.cat_file(f"{target}/ckptflow_manifest.json"))
    return {name: entry["sha256"] for name, entry in manifest["files"].items() if name.endswith(".safetensors")}


def run_local(args, role: Path, url: str, env: dict, home: Path) -> None:
    from mergecore import prepare

    plan = prepare(str(role), dtype="bf16").plan
    group_bytes = {g: sum(t.end - t.begin for t in plan.in_group(g)) for g in plan.groups}
    seconds: dict[int, list[float]] = {1: [], 2: []}
    shares: list[list[float]] = []
    for round_ in range(args.repeat):
        for workers in (1, 2) if round_ % 2 == 0 else (2, 1):
            subprocess.run(["cat", *map(str, role.glob("model_*.pt"))], stdout=subprocess.DEVNULL, check=True)
            target = home / f"out-{round_}-{workers}" / "model"
            since = datetime.now(timezone.utc)
            seconds[workers].append(measure(local_promote_argv(role, target, workers), env)["seconds"])
            if workers == 2:
                shares.append(worker_shares(url, since, group_bytes))
            shutil.rmtree(target.parent)
            print(f"  {workers} worker(s): {seconds[workers][-1]:.1f} s", flush=True)
    one, two = statistics.median(seconds[1]), statistics.median(seconds[2])
    largest = statistics.median(s[0] for s in shares)
    size = sum(group_bytes.values()) / 1e9
    print(f"\nlocal files, promote --task-runner dask, {size:.2f} GB bf16 out, medians of {args.repeat}: "
          f"1 worker {one:.1f} s, 2 workers {two:.1f} s, throughput ratio 2/1 = {one / two:.2f}x")
    print(f"largest worker share with 2 workers: {largest:.0%} of the bytes (shares per run: "
          f"{[[round(x, 2) for x in s] for s in shares]}); on separate machines the merge phase would take "
          f"~{largest:.0%} of the one-worker time")


def one_s3_sample(source: str, target: str, workers: int, args, env: dict, dask_dir: Path) -> dict:
    """One promotion on a fresh LocalCluster of `workers` processes: seconds and each worker's counted reads."""
    from distributed import Client, LocalCluster

    from ckptflow.testing.s3_reads import count_s3_reads, s3_reads

    started = time.perf_counter()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", local_directory=str(dask_dir)) as cluster, \
            Client(cluster) as client:
        client.run(count_s3_reads)
        cluster_start = time.perf_counter() - started
        seconds = measure(s3_promote_argv(source, target, cluster.scheduler_address, args.max_shard_size), env)["seconds"]
        reads = [fetched for _, fetched, _ in client.run(s3_reads).values()]
    return {"seconds": seconds, "cluster_start": cluster_start, "reads": reads}


def per_worker(reads: list[dict[str, int]], target: str, model_bytes: int, weight_bytes: int) -> list[dict]:
    """Each worker's rank-file bytes and read-back output bytes as shares of the model, largest reader first."""
    key_prefix = target.split("://")[-1] + "/"
    rows = []
    for fetched in reads:
        outputs = {k: n for k, n in fetched.items() if k.startswith(key_prefix) and k.endswith(".safetensors")}
        rows.append({"read": sum(n for k, n in fetched.items() if "/model_world_size_" in k) / model_bytes,
                     "written": sum(outputs.values()) / weight_bytes, "files": len(outputs),
                     "optimizer": sum(n for k, n in fetched.items() if "/optim_" in k or "/extra_state_" in k)})
    return sorted(rows, key=lambda row: row["read"], reverse=True)


def run_s3(args, role: Path, env: dict, home: Path) -> None:
    from mergecore import prepare

    moto, endpoint = start_moto()
    try:
        env.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                    "FSSPEC_S3_ENDPOINT_URL": endpoint, "CKPTFLOW_CACHE": str(home / "cache")})
        os.environ.update(env)  # the LocalCluster's worker processes inherit it: endpoint, credentials, Prefect API
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        fs.mkdir(SOURCE_PREFIX.split("/")[0])
        fs.mkdir(TARGET_BUCKET)
        started = time.perf_counter()
        fs.put(str(role), SOURCE_PREFIX, recursive=True)
        print(f"checkpoint uploaded to moto in {time.perf_counter() - started:.1f} s", flush=True)
        source = f"s3://{SOURCE_PREFIX}"

        plan = prepare(str(role), dtype="bf16", max_shard_size=args.max_shard_size).plan
        file_bytes = {f: plan.file_size(f) for f in plan.files}
        weight_bytes = sum(file_bytes.values())
        model_bytes = sum(p.stat().st_size for p in role.glob("model_world_size_*.pt"))
        samples: dict[int, list[dict]] = {1: [], 2: []}
        sha256s: list[dict[str, str]] = []
        for round_ in range(args.repeat):
            for workers in (1, 2) if round_ % 2 == 0 else (2, 1):
                target = f"s3://{TARGET_BUCKET}/run-{round_}-{workers}"
                sample = one_s3_sample(source, target, workers, args, env, home / "dask")
                sample["workers"] = per_worker(sample["reads"], target, model_bytes, weight_bytes)
                sha256s.append(weight_sha256s(fs, target))
                fs.rm(target, recursive=True)  # moto keeps objects in memory
                samples[workers].append(sample)
                print(f"  {workers} worker(s): {sample['seconds']:.1f} s (cluster start {sample['cluster_start']:.1f} s, "
                      f"apart); per worker read/wrote "
                      f"{[(round(w['read'], 2), round(w['written'], 2), w['files']) for w in sample['workers']]}",
                      flush=True)
    finally:
        moto.terminate()
        moto.wait()
    report_s3(args, samples, sha256s, file_bytes, model_bytes, weight_bytes)


def report_s3(args, samples: dict[int, list[dict]], sha256s: list[dict], file_bytes: dict[str, int],
              model_bytes: int, weight_bytes: int) -> None:
    if any(s != sha256s[0] for s in sha256s) or len(sha256s[0]) != len(file_bytes):
        raise SystemExit(f"runs wrote different weight files: {sha256s}")
    one = statistics.median(s["seconds"] for s in samples[1])
    two = statistics.median(s["seconds"] for s in samples[2])
    largest_read = statistics.median(s["workers"][0]["read"] for s in samples[2])
    largest_written = statistics.median(max(w["written"] for w in s["workers"]) for s in samples[2])
    largest = max(largest_read, largest_written)
    largest_file = max(file_bytes.values()) / weight_bytes
    optimizer = sum(w["optimizer"] for runs in samples.values() for s in runs for w in s["workers"])
    print(f"\ns3 -> s3 on moto, promote --task-runner dask --max-shard-size {args.max_shard_size} "
          f"({len(file_bytes)} files, {weight_bytes / 1e9:.2f} GB bf16 out of {model_bytes / 1e9:.2f} GB fp32 rank "
          f"files), medians of {args.repeat}: 1 worker {one:.1f} s, 2 workers {two:.1f} s, "
          f"throughput ratio 2/1 = {one / two:.2f}x; cluster start (apart) "
          f"{statistics.median(s['cluster_start'] for runs in samples.values() for s in runs):.1f} s")
    for workers, runs in samples.items():
        print(f"  {workers} worker(s), per run, per worker (rank-file bytes read, output bytes read back, as shares "
              f"of the model; files): {[[(round(w['read'], 2), round(w['written'], 2), w['files']) for w in s['workers']] for s in runs]}")
    print(f"  optimizer/extra-state bytes read by any worker: {optimizer}; every run's weight files have the same sha256s")
    print(f"on N machines, each with its own path to the store, the file phase is bound by the largest worker's "
          f"share: with 2 about {largest:.0%} of the one-worker transfer (here {largest_read:.0%} of the rank bytes, "
          f"{largest_written:.0%} of the output); with N >= {round(1 / largest_file)} about the largest file, "
          f"{largest_file:.0%} (files are the unit of work), plus the fixed costs (flow start, planning, "
          f"finalize on one machine). moto on 2 shared cores is one Python process, not S3.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--local", action="store_true", help="local files to a local folder instead of s3 on moto")
    parser.add_argument("--max-shard-size", default="40MB", help="s3 mode: output file size (several per worker)")
    args = parser.parse_args()

    role = checkpoint(args.work, 2)
    home = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    server, url = start_server(home / "prefect")
    env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(home / "prefect"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    try:
        if args.local:
            run_local(args, role, url, env, home)
        else:
            run_s3(args, role, env, home)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(home, ignore_errors=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
