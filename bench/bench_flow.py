"""Benchmark the Prefect pipeline against the bare merge on a bench checkpoint.

    python bench/bench_flow.py                 # after bench/bench_merge.py has written bench/_work/ckpt-10-layers
    python bench/bench_flow.py --layers 44     # an 8.45 GB checkpoint, written here the first time (delete it after)

Starts a Prefect server (its start-up is excluded: deployments run against a long-lived one), then
times in this process, medians of --repeat, bare and flow samples in alternating order, each after the
server has gone idle and the input was read into page cache (this machine reclaims idle page cache
within a second or two), with the flow's per-process cache of opened checkpoints emptied first: the bare `merge_checkpoint`, a cold promotion as
`ckptflow promote` runs it (fresh result storage), a rerun (every group cached), an empty flow
run (Prefect's fixed cost), and the promotion's DAG with no-op tasks (Prefect's cost of a DAG of
this shape: two flow runs, as many task runs and artifacts, no caching, no files).

The restated pipeline goals, printed as lines with met / not met (each term a median of --repeat):
- own cost, cold = (cold promotion - no-op DAG) - bare merge, as % of the bare merge; goal <= 5%.
  What a cold promotion costs beyond Prefect's floor for this DAG shape and the merge itself:
  task bodies' own work (discovery, validation, planning, caching bookkeeping, the round-trip check,
  reports, result persistence) and the Prefect calls ckptflow adds beyond the skeleton's.
- own cost, cached = (cached rerun - no-op DAG), as % of the bare merge; goal <= 5%. The rerun
  merges nothing; the floor subtracted is the same cold DAG (with a task run per group), so a
  negative value means the rerun is cheaper than Prefect's floor for the cold shape.
- cold flow / bare merge <= 1.2x, a goal for checkpoints of >= 8 GB of rank files (`--layers 44`):
  printed for every size, marked as applying or not.

Checkpoints are bench_merge's shape (W=4 FSDP2, Qwen2-like, hidden 2048; 2.33 GB at 10 layers, +0.18 GB a
layer). Up to 20 layers they are written by real FSDP (bench_merge.checkpoint); beyond, real FSDP would hold W
copies of the model with its optimizer in RAM, so the rank files come from ckptflow.testing.large_world: the
same DTensor pickles built from local chunks under torch's fake process group, seeded (untrained) values.
Everything stays under --work (bench/_work, git-ignored).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return server, url
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise RuntimeError("Prefect server did not start")


REAL_FSDP_MAX_LAYERS = 20  # beyond, W=4 ranks each holding the model, grads and Adam state outgrow this machine


def bench_checkpoint(work: Path, layers: int) -> Path:
    """The role folder of bench_merge's checkpoint shape with `layers` layers, written once under `work`."""
    sys.path.insert(0, str(HERE))
    from bench_merge import bench_spec, checkpoint

    if layers <= REAL_FSDP_MAX_LAYERS:
        return checkpoint(work, layers)
    root = work / f"ckpt-{layers}-layers"
    role = root / "global_step_1" / "actor"
    if not (role / "model_world_size_4_rank_3.pt").exists():
        from ckptflow.testing.large_world import LargeWorldSpec, write_large_world

        shutil.rmtree(root, ignore_errors=True)
        spec = bench_spec(layers)
        print(f"writing the {layers}-layer checkpoint under a fake process group (once; kept in {work})...", flush=True)
        write_large_world(root, LargeWorldSpec(
            world_size=spec.world_size, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=layers,
            num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads))
        shutil.rmtree(root / "reference")  # not needed here; saves disk
    return role


def goal_line(label: str, value: float, unit: str, goal: float, applies: bool = True) -> str:
    verdict = ("met" if value <= goal else "NOT met") if applies else "n/a here"
    return f"  GOAL {label:<44} {value:7.3f}{unit}  (goal <= {goal:g}{unit}): {verdict}"


def prepared(role: str):
    from mergecore import prepare

    return prepare(role, dtype="bf16")


def same_shape_dag(groups: int):
    """promote_checkpoint's flows, task runs and artifacts, with tasks that do nothing."""
    from prefect import flow, task
    from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                                   update_progress_artifact)
    from prefect.cache_policies import NO_CACHE
    from prefect.futures import wait
    from prefect.task_runners import ThreadPoolTaskRunner

    @task(cache_policy=NO_CACHE)
    def noop(*args) -> None:
        return None

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def merge_shape() -> None:
        for _ in range(4):  # discover, validate, plan, prepare staging
            noop()
        wait([noop.submit(g) for g in range(groups)])
        progress = create_progress_artifact(0.0)
        update_progress_artifact(progress, 100.0)
        noop()  # finalize
        create_markdown_artifact("report")

    @flow
    def promote_shape() -> None:
        merge_shape()
        noop()  # equivalence tests
        create_table_artifact([{"check": "round-trip"}])

    return promote_shape


def forget_opened_checkpoints() -> None:
    """Drop tasks.sources' per-process memo of opened (mmapped) checkpoints."""
    from ckptflow.tasks.sources import forget_opened

    forget_opened()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int, window: float = 0.3, busy: float = 0.05, limit: float = 20.0) -> None:
    """Wait until process `pid` uses under `busy` of a CPU over `window` seconds (at most `limit`)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(window)
        if cpu_seconds(pid) - before < busy * window:
            return


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=10,
                        help="checkpoint size: 10 = 2.33 GB (the usual bench), 44 = 8.45 GB of fp32 rank files")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    role = bench_checkpoint(args.work.resolve(), args.layers)
    size_gb = sum(f.stat().st_size for f in role.glob("model_*.pt")) / 1e9
    print(f"{role}: {size_gb:.2f} GB of fp32 rank files; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    server, url = start_server(args.work / "prefect-home")
    os.environ.update(PREFECT_API_URL=url, PREFECT_LOGGING_LEVEL="WARNING")
    try:
        from prefect import flow

        from ckptflow.flows.requests import PromotionRequest
        from ckptflow.flows.run import run_promotion
        from ckptflow.flows.settings import in_process_settings
        from mergecore import merge_checkpoint

        @flow
        def empty() -> None:
            return None

        groups = len(prepared(str(role)).plan.groups)
        skeleton = same_shape_dag(groups)

        out = args.work / "flow-out"
        bare, cold, rerun, shape = [], [], [], []
        with in_process_settings():  # as the CLI runs flows: no heartbeat thread to join
            empty()  # registers the flow
            # measured on a quiet client: right after a promotion an empty run also waits for the
            # previous run's events and logs to drain (~1.8 s here), which is not its own cost
            fixed = [timed(empty) for _ in range(args.repeat)]
            skeleton()  # registers its flows
        def quiet() -> None:
            """The server done with the previous run's events (else the next sample shares the CPUs with
            them), no output of the previous sample, no dirty pages being written back, and the input
            in page cache, read last: this machine reclaims idle page cache within a second or two."""
            settle(server.pid)
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(f"sync && cat {role}/model_*.pt > /dev/null", shell=True, check=True)

        def bare_sample() -> None:
            quiet()
            bare.append(timed(lambda: merge_checkpoint(str(role), out, dtype="bf16")))

        def flow_samples() -> None:
            quiet()
            os.environ["CKPTFLOW_RESULTS"] = str(args.work / f"flow-results-{time.time_ns()}")
            forget_opened_checkpoints()  # as a fresh `ckptflow promote` process: the source opened anew
            cold.append(timed(lambda: run_promotion(PromotionRequest.of(str(role), str(out), dtype="bf16"))))
            rerun.append(timed(lambda: run_promotion(PromotionRequest.of(str(role), str(out), dtype="bf16"))))

        for i in range(args.repeat):  # bare and flow in alternating order: drift hits both alike
            for sample in (bare_sample, flow_samples) if i % 2 == 0 else (flow_samples, bare_sample):
                sample()
        with in_process_settings():
            for _ in range(args.repeat):
                quiet()
                shape.append(timed(skeleton))
        med = {name: statistics.median(v) for name, v in
               {"bare": bare, "cold": cold, "rerun": rerun, "fixed": fixed, "shape": shape}.items()}
        print("samples (s): " + "; ".join(f"{name} " + " ".join(f"{v:.2f}" for v in values)
                                          for name, values in (("bare", bare), ("cold", cold), ("rerun", rerun), ("no-op DAG", shape))))
        print(f"medians of {args.repeat} ({args.layers}-layer bench checkpoint, {size_gb:.2f} GB fp32, to bf16, "
              f"warm page cache, server running; load {os.getloadavg()[0]:.1f} now)")
        print(f"  bare merge_checkpoint        {med['bare']:6.2f} s")
        pairs = statistics.median(c / b for c, b in zip(cold, bare))
        print(f"  promote_checkpoint, cold     {med['cold']:6.2f} s   flow / bare = {med['cold'] / med['bare']:.2f}x;"
              f" median of the pairs' ratios {pairs:.2f}x")
        print(f"  promote_checkpoint, rerun    {med['rerun']:6.2f} s   (every group cached)")
        print(f"  empty flow run               {med['fixed']:6.2f} s   (Prefect's fixed cost per run)")
        fixed = 2 * med["fixed"]  # promote is a flow plus a subflow
        print(f"  cold run beyond fixed cost: {med['cold'] - fixed:.2f} s = {(med['cold'] - fixed) / med['bare']:.2f}x bare")
        beyond = max(0.0, med["rerun"] - fixed)
        print(f"  rerun beyond fixed cost: {beyond:.2f} s = {100 * beyond / med['bare']:.0f}% of a cold merge")
        print(f"  same DAG, no-op tasks        {med['shape']:6.2f} s   ({groups} groups: Prefect's cost of this DAG's runs, tasks, artifacts)")
        print(f"  cold run beyond that DAG: {med['cold'] - med['shape']:.2f} s = {(med['cold'] - med['shape']) / med['bare']:.2f}x bare (ckptflow's own cold work)")
        beyond = max(0.0, med["rerun"] - med["shape"])
        print(f"  rerun beyond that DAG: {beyond:.2f} s = {100 * beyond / med['bare']:.0f}% of a cold merge (ckptflow's own rerun work)")
        own_cold = (med["cold"] - med["shape"]) - med["bare"]
        own_cached = med["rerun"] - med["shape"]
        print(goal_line("own cost cold: (cold - no-op DAG) - bare", 100 * own_cold / med["bare"], "%", 5))
        print(goal_line("own cost cached: rerun - no-op DAG", 100 * own_cached / med["bare"], "%", 5))
        print(goal_line(f"cold flow / bare on >= 8 GB ({size_gb:.2f} GB here)", med["cold"] / med["bare"], "x", 1.2,
                        applies=size_gb >= 8))
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
