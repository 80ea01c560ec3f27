"""1 vs 2 Dask workers: `ckptflow promote --task-runner dask --dask-workers N`, whole processes.

    python bench/bench_dask.py [--work bench/_work] [--repeat 3]   # uses bench_merge.py's 2-layer checkpoint

Against a long-lived Prefect server started here (its start-up excluded), N=1 and N=2 alternate, each
with a fresh target (no cached group), after the rank files were read into page cache. Reported: the
medians of the whole process (LocalCluster start and stop included: 4-5 s here), the throughput ratio
N=1/N=2, and from merge_group's log lines (group -> worker pid) and the plan, the share of the model's
bytes each worker merged. On 2 shared cores the ratio says little; on N machines, each reading its
own share from object storage, a merge bound by network or disk takes about (largest share) of the
one-worker time plus the fixed costs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def promote_argv(role: Path, target: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "promote", str(role), "--target", str(target), "--dtype", "bf16",
            "--task-runner", "dask", "--dask-workers", str(workers)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from mergecore import prepare

    role = checkpoint(args.work, 2)
    plan = prepare(str(role), dtype="bf16").plan
    group_bytes = {g: sum(t.end - t.begin for t in plan.in_group(g)) for g in plan.groups}
    home = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    server, url = start_server(home / "prefect")
    env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(home / "prefect"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    seconds: dict[int, list[float]] = {1: [], 2: []}
    shares: list[list[float]] = []
    try:
        for round_ in range(args.repeat):
            for workers in (1, 2) if round_ % 2 == 0 else (2, 1):
                subprocess.run(["cat", *map(str, role.glob("model_*.pt"))], stdout=subprocess.DEVNULL, check=True)
                target = home / f"out-{round_}-{workers}" / "model"
                since = datetime.now(timezone.utc)
                seconds[workers].append(measure(promote_argv(role, target, workers), env)["seconds"])
                if workers == 2:
                    shares.append(worker_shares(url, since, group_bytes))
                shutil.rmtree(target.parent)
                print(f"  {workers} worker(s): {seconds[workers][-1]:.1f} s", flush=True)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(home, ignore_errors=True)
    one, two = statistics.median(seconds[1]), statistics.median(seconds[2])
    largest = statistics.median(s[0] for s in shares)
    size = sum(group_bytes.values()) / 1e9
    print(f"\npromote --task-runner dask, {size:.2f} GB bf16 out, medians of {args.repeat}: "
          f"1 worker {one:.1f} s, 2 workers {two:.1f} s, throughput ratio 2/1 = {one / two:.2f}x")
    print(f"largest worker share with 2 workers: {largest:.0%} of the bytes (shares per run: "
          f"{[[round(x, 2) for x in s] for s in shares]}); on separate machines the merge phase would take "
          f"~{largest:.0%} of the one-worker time")


if __name__ == "__main__":
    main()
