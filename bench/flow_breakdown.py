"""Where a cold promotion's time goes: the bare merge's phase timings beside the flow's task runs.

    python bench/flow_breakdown.py --layers 44 --rounds 2

Against a running Prefect server, `--rounds` pairs of (bare merge_checkpoint, cold promotion), each after
bench_flow's quiet(): the bare merge's manifest timings (prepare, merge, verify) and, for the promotion,
each task run's start (seconds after the call) and run time read back from the server, with the span of
the merge_group task runs (first start to last end). One sample each: a breakdown, not a benchmark.
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flow as bf  # noqa: E402


async def task_runs_since(started: float) -> list:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        runs = await client.read_task_runs(limit=200)  # the server caps a page at 200: enough for one recent run
    return sorted((r for r in runs if r.start_time and r.start_time.timestamp() >= started - 1), key=lambda r: r.start_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=bf.HERE / "_work")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    role = bf.bench_checkpoint(work, args.layers)
    server, url = bf.start_server(work / "prefect-home")
    os.environ.update(PREFECT_API_URL=url, PREFECT_LOGGING_LEVEL="WARNING")
    try:
        from ckptflow.flows.requests import PromotionRequest
        from ckptflow.flows.run import run_promotion
        from mergecore import merge_checkpoint

        out = work / "breakdown-out"

        def quiet() -> None:
            bf.settle(server.pid)
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(f"sync && cat {role}/model_*.pt > /dev/null", shell=True, check=True)

        for _ in range(args.rounds):
            quiet()
            seconds = bf.timed(lambda: merge_checkpoint(str(role), out, dtype="bf16"))
            timings = json.loads((out / "ckptflow_manifest.json").read_text())["timings"]
            print(f"bare {seconds:.2f} s, phases {timings}", flush=True)
            quiet()
            os.environ["CKPTFLOW_RESULTS"] = str(work / f"breakdown-results-{time.time_ns()}")
            bf.forget_opened_checkpoints()
            started = time.time()
            seconds = bf.timed(lambda: run_promotion(PromotionRequest.of(str(role), str(out), dtype="bf16")))
            timings = json.loads((out / "ckptflow_manifest.json").read_text()).get("timings")
            print(f"cold {seconds:.2f} s, finalize phases {timings}", flush=True)
            runs = asyncio.run(task_runs_since(started))
            groups = [r for r in runs if r.name.startswith("merge_group")]
            if groups:
                first, last = min(r.start_time for r in groups), max(r.end_time for r in groups)
                print(f"  merge_group x{len(groups)}: +{first.timestamp() - started:.2f} s to "
                      f"+{last.timestamp() - started:.2f} s (span {(last - first).total_seconds():.2f} s)")
            for r in runs:
                if not r.name.startswith("merge_group"):
                    print(f"  {r.name:<30} +{r.start_time.timestamp() - started:6.2f} s  ran {r.total_run_time.total_seconds():6.2f} s")
        shutil.rmtree(out, ignore_errors=True)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
