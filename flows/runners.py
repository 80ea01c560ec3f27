"""Where merge_unit tasks run: threads of the flow's process, or the processes of a Dask cluster.

    runner = group_task_runner("dask", dask_workers=2, target="/models/step-100")
    merge_checkpoint.with_options(task_runner=runner)(request)

Only merge_unit is submitted to the runner; discovery,
planning, staging and finalize (which takes the publish lock) run in the flow's own process. Workers must
reach the same results folder (cache records and locks, see tasks/caching.py) and, for a local target, the
same staging folder: on one machine they do; across machines, a shared file system (CKPTFLOW_RESULTS on
it). An s3:// target needs no shared staging: each worker streams its files to it.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from mergecore import CheckpointError

TASK_RUNNERS = ("threads", "dask")
THREADS = 2  # groups merged at once by the default runner
CONNECT_SECONDS = 5.0


def check_runner_options(task_runner: str, dask_address: str | None, dask_workers: int | None) -> None:
    """One-line refusal of a runner choice that cannot work; nothing is contacted.

    >>> check_runner_options("dask", "tcp://10.0.0.5:8786", None)  # an existing cluster
    >>> check_runner_options("dask", None, 4)  # a LocalCluster of 4 processes
    """
    if task_runner not in TASK_RUNNERS:
        raise CheckpointError(f"--task-runner {task_runner}: choose one of {', '.join(TASK_RUNNERS)}")
    if task_runner != "dask":
        if dask_address is not None or dask_workers is not None:
            raise CheckpointError("--dask-address and --dask-workers apply with --task-runner dask: add it or drop them")
        return
    if dask_address is not None and dask_workers is not None:
        raise CheckpointError(f"--dask-address {dask_address} and --dask-workers {dask_workers}: an existing cluster "
                              "has its own workers; give one of them")
    if dask_workers is not None and dask_workers < 1:
        raise CheckpointError(f"--dask-workers {dask_workers}: give at least 1 worker process")
    if dask_address is not None:
        scheduler_host_port(dask_address)


def scheduler_host_port(address: str) -> tuple[str, int]:
    """('10.0.0.5', 8786) for 'tcp://10.0.0.5:8786'; a one-line error for anything else."""
    from distributed.comm import parse_address, parse_host_port

    try:
        protocol, location = parse_address(address, strict=True)
        if protocol not in ("tcp", "tls"):
            raise ValueError(protocol)
        return parse_host_port(location)
    except (ValueError, TypeError):
        raise CheckpointError(f"--dask-address {address}: give the scheduler as tcp://HOST:PORT "
                              "(what `dask scheduler` prints)") from None


def check_scheduler_answers(address: str) -> None:
    """Fail in seconds, with the fix, when nothing listens at `address` (Dask itself waits 30 s)."""
    host, port = scheduler_host_port(address)
    try:
        socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        raise CheckpointError(f"--dask-address {address}: no Dask scheduler answers ({error.strerror or error}); "
                              "start one with `dask scheduler` or use --dask-workers N for a local cluster") from None


def seen_from_workers(path: str | None) -> str | None:
    """A local path made absolute (workers of an existing cluster run in folders of their own); URLs as given."""
    if path is None or "://" in path:
        return path
    return str(Path(path).absolute())


def group_task_runner(task_runner: str, dask_address: str | None = None, dask_workers: int | None = None):
    """The task runner for merge_group: a thread pool, or a DaskTaskRunner on `dask_address` or on a
    LocalCluster of `dask_workers` processes (default 2) that lives as long as the merge."""
    check_runner_options(task_runner, dask_address, dask_workers)
    if task_runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=THREADS)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise CheckpointError("--task-runner dask needs prefect-dask: pip install 'ckptflow[pipeline]'") from None

    if dask_address is not None:
        check_scheduler_answers(dask_address)
        return DaskTaskRunner(address=dask_address, client_kwargs={"timeout": f"{CONNECT_SECONDS * 2:g}s"})
    # one thread per process: a group already reads with its own threads, and its memory budget is per process
    return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                          cluster_kwargs={"n_workers": dask_workers or 2, "threads_per_worker": 1, "processes": True,
                                          "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
                                          "local_directory": tempfile.gettempdir()})
