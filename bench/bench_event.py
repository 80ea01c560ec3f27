"""Event to verified model on a real Prefect server and process worker, phase by phase.

    python bench/bench_event.py                  # 5 samples after one warm-up
    python bench/bench_event.py --query-seconds 0.5
    python bench/bench_event.py --database-url postgresql+asyncpg://prefect:prefect@127.0.0.1/prefect

Writes a tiny verl FSDP checkpoint once (`ckptflow demo-checkpoint`: 2 gloo ranks, hidden 128) under --work,
starts a Prefect server, a loopback Hub (tests/hub_server.py) and `ckptflow deploy --target-root ... --hub-org
acme`, then a process worker (`prefect worker start`, polling every --query-seconds), the way docs/service.md
deploys it. Each sample copies the checkpoint to a new `global_step_N` folder (a checkpoint not seen before:
merged, proven and pushed to a new branch) and announces it as `ckptflow notify` does, after the server and
the worker have gone idle. The first announcement is a warm-up (the config check's first answer, the repo's
creation) and is printed but not counted.

Each phase is read back from the server's own clock: the event's time, the run's creation (the automation),
Pending (the worker took it), Running (the flow-run process reached the flow), Completed (model published and
pushed). Prints the median of each phase and the goal line: event to verified model <= 5 s. The last phase is
then split by the task runs inside it (read once every run is over: their states reach the server as events):
the time some task body was running, per task, and the rest (Prefect creating and closing the nested flow runs
and task runs, artifacts, the flows' own code between tasks).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the loopback Hub

from bench_flow import goal_line, settle, start_server  # noqa: E402

PHASES = ("automation (event -> run created)", "worker poll (created -> pending)",
          "flow process start (pending -> running)", "flows, proofs, push (running -> completed)")


def checkpoint(work: Path) -> Path:
    """The demo run's role folder (run/global_step_1/actor), written once."""
    run = work / "run"
    role = run / "global_step_1" / "actor"
    if not (role / "huggingface" / "config.json").exists():
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "demo-checkpoint", str(run), "--world-size", "2",
                        "--hidden-size", "128"], check=True, cwd=REPO)
    return role


def new_step(role: Path, step: int) -> Path:
    """A copy of the checkpoint as training step `step` of the same run."""
    copy = role.parent.parent / f"global_step_{step}" / role.name
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(role, copy)
    return copy


def marks(run_id, occurred: datetime.datetime) -> list[datetime.datetime]:
    """The event's time, then the run's creation, Pending, Running and Completed, from the server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        created = client.read_flow_run(run_id).created
        states = {s.type.value: s.timestamp for s in client.read_flow_run_states(run_id)}
    return [occurred, created, states["PENDING"], states["RUNNING"], states["COMPLETED"]]


def seconds_between(moments: list[datetime.datetime]) -> list[float]:
    return [(later - earlier).total_seconds() for earlier, later in zip(moments, moments[1:])]


def every(read, page: int = 200) -> list:
    """All the runs a `client.read_*_runs` gives, page by page (the server answers at most 200 at a time)."""
    found: list = []
    while batch := read(limit=page, offset=len(found)):
        found += batch
        if len(batch) < page:
            break
    return found


def inside_the_run(windows: list[tuple[datetime.datetime, datetime.datetime]]) -> None:
    """Median seconds per task name within each run's Running -> Completed window, the time some task body ran
    (their union), and the rest. A nested flow's own task run (its stand-in in the parent) is left out."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        nested = {r.parent_task_run_id for r in every(client.read_flow_runs)}  # a nested flow's stand-in task run
        runs = [r for r in every(client.read_task_runs) if r.start_time and r.end_time and r.id not in nested]
    per_task: dict[str, list[float]] = {}
    in_tasks, outside = [], []
    for start, end in windows:
        inside = sorted((r for r in runs if start <= r.start_time <= end), key=lambda r: r.start_time)
        busy, reach = 0.0, start
        for run in inside:
            begin = max(run.start_time, reach)
            if run.end_time > begin:
                busy += (run.end_time - begin).total_seconds()
                reach = run.end_time
        in_tasks.append(busy)
        outside.append((end - start).total_seconds() - busy)
        totals: dict[str, float] = {}
        for run in inside:
            name = run.name.split("[")[0].rsplit("-", 1)[0]
            totals[name] = totals.get(name, 0.0) + (run.end_time - run.start_time).total_seconds()
        for name, total in totals.items():
            per_task.setdefault(name, []).append(total)
    print(f"  inside the last phase: some task body running {statistics.median(in_tasks):.2f} s, "
          f"the rest {statistics.median(outside):.2f} s (Prefect's flow and task runs, artifacts, the flows' code)")
    for name, values in sorted(per_task.items(), key=lambda item: -statistics.median(item[1])):
        print(f"    {name:<40} {statistics.median(values):6.3f} s")


def one_event(role: Path, step: int) -> list[datetime.datetime]:
    from ckptflow.flows.events import api_url, checkpoint_event, follow_run, post_events, triggered_run

    event = checkpoint_event(str(new_step(role, step)))
    post_events(api_url(), [event])
    finished = follow_run(triggered_run(event).id, 120)
    if not finished.state.is_completed():
        raise RuntimeError(f"run {finished.name} ended {finished.state.name}: {finished.state.message}")
    return marks(finished.id, datetime.datetime.fromisoformat(event["occurred"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work" / "event")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--query-seconds", type=float, default=1.0, help="the worker's PREFECT_WORKER_QUERY_SECONDS")
    parser.add_argument("--database-url", help="the server's database (PREFECT_SERVER_DATABASE_CONNECTION_URL; "
                        "default: Prefect's SQLite file); its tables are emptied first")
    args = parser.parse_args()
    from hub_server import HubServer

    args.work.mkdir(parents=True, exist_ok=True)
    role = checkpoint(args.work)
    home = args.work / "service"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    with HubServer(tokens={"hf_alice": "alice"}, orgs={"acme": {"alice"}}) as hub:
        os.environ.update({"PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                           "PREFECT_UI_ENABLED": "false", "HF_ENDPOINT": hub.url, "HF_HOME": str(home / "hf"),
                           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "hf_alice",
                           "PYTHONPATH": str(REPO), "CKPTFLOW_CONFIG_CACHE": str(home / "config-cache")})
        if args.database_url:
            os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = args.database_url
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "reset", "--yes"], check=True,
                           stdout=subprocess.DEVNULL)
        server, api = start_server(home)
        os.environ["PREFECT_API_URL"] = api
        worker = None
        try:
            subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "deploy", "--target-root", str(home / "models"),
                            "--hub-org", "acme", "--checkpoint-root", str(role.parent.parent)], check=True, cwd=REPO)
            worker_env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": str(args.query_seconds)}
            worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "ckptflow-process",
                                       "--type", "process"], env=worker_env, cwd=REPO, start_new_session=True,
                                      stdout=open(home / "worker.log", "wb"), stderr=subprocess.STDOUT)
            samples, windows = [], []
            for step in range(2, args.repeat + 3):
                settle(server.pid)
                settle(worker.pid)
                moments = one_event(role, step)
                seconds = seconds_between(moments)
                label = "warm-up" if step == 2 else f"sample {step - 2}"
                print(f"{label}: {sum(seconds):.2f} s = " + " + ".join(f"{s:.2f}" for s in seconds), flush=True)
                if step > 2:
                    samples.append(seconds)
                    windows.append((moments[-2], moments[-1]))
            settle(server.pid)  # the task runs' last states are events: let the server take them in
            print_medians(samples, args.query_seconds)
            inside_the_run(windows)
        finally:
            for process in (worker, server):
                if process is not None:
                    process.terminate()
                    process.wait(30)


def print_medians(samples: list[list[float]], query_seconds: float) -> None:
    print(f"\nmedians of {len(samples)} events (worker polling every {query_seconds:g} s):")
    for name, values in zip(PHASES, zip(*samples)):
        print(f"  {name:<44} {statistics.median(values):6.2f} s")
    print(goal_line("event -> verified model (median)", statistics.median(map(sum, samples)), " s", 5.0))


if __name__ == "__main__":
    main()
