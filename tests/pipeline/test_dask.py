"""merge_group on Dask (prefect-dask's DaskTaskRunner): the bytes of the thread runner, merged in the
cluster's worker processes, with the cache reachable from every worker. Each test starts one or two
2-process LocalClusters (4-5 s each here), so there are few of them."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from datetime import datetime, timezone

import pytest
from safetensors.numpy import load_file, save_file
from helpers import GROUPS, free_port, merge_group_states, rank_file_bytes

from ckptflow.flows.promote import promote_checkpoint
from ckptflow.flows.requests import PromotionRequest

MERGED_BY = re.compile(r"group (\S+) merged by process (\d+) on (\S+)")
DESCRIBES_THE_RUN = ("ckptflow_manifest.json", "README.md")  # the manifest and card record the checks run


@pytest.fixture(scope="module")
def by_threads(prefect_server, demo, tmp_path_factory):
    """The demo checkpoint promoted with the default thread runner: the bytes Dask must reproduce."""
    target = tmp_path_factory.mktemp("threads") / "model"
    promote_checkpoint(PromotionRequest.of(str(demo("fsdp2-w2").run_root), str(target)))
    return target


def assert_same_model(folder, expected):
    names = sorted(p.name for p in expected.iterdir() if p.name not in DESCRIBES_THE_RUN)
    assert sorted(p.name for p in folder.iterdir() if p.name not in DESCRIBES_THE_RUN) == names
    for name in names:
        assert (folder / name).read_bytes() == (expected / name).read_bytes(), name


def where_groups_ran(since: datetime) -> dict[str, tuple[int, str]]:
    """{group: (pid, host)} from merge_group's log lines sent to the server after `since`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    found: dict = {}
    for _ in range(100):  # logs reach the server in batches
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)))
        found = {m[1]: (int(m[2]), m[3]) for m in (MERGED_BY.search(log.message) for log in logs) if m}
        if len(found) == len(GROUPS):
            break
        time.sleep(0.2)
    return found


def wrong_reference(reference_dir, root):
    """The trained model's folder with one weight changed: the reference check must refuse to publish."""
    folder = shutil.copytree(reference_dir, root / "wrong-reference")
    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.0.mlp.down_proj.weight"))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


ARCHIVE_METADATA = 2 * 32 << 10  # a worker also reads both rank archives' directories and pickles


def rank_bytes_of(ckpt, merged, files) -> int:
    """Bytes the rank files hold of the tensors in output `files` of the `merged` folder (its index says which)."""
    weight_map = json.loads((merged / "model.safetensors.index.json").read_text())["weight_map"]
    return rank_file_bytes(ckpt, [name for name, file in weight_map.items() if file in files])


def test_local_cluster_merges_the_thread_bytes_in_worker_processes_and_caches_them(cli, demo, by_threads, tmp_path):
    ckpt = demo("fsdp2-w2")
    target = tmp_path / "model"
    dask = ("--task-runner", "dask", "--dask-workers", "2")

    since = datetime.now(timezone.utc)
    refused = cli("promote", ckpt.run_root, "--target", target, "--reference", wrong_reference(ckpt.reference_dir, tmp_path), *dask)
    assert refused.exit_code == 3, refused.output  # every group merged, then the reference check failed
    assert not target.exists()
    assert merge_group_states()[-1] == {g: "Completed" for g in GROUPS}
    ran = where_groups_ran(since)
    assert sorted(ran) == sorted(GROUPS)
    assert all(pid != os.getpid() and host == socket.gethostname() for pid, host in ran.values())

    rerun = cli("promote", ckpt.run_root, "--target", target, "--reference", ckpt.reference_dir, *dask)
    assert rerun.exit_code == 0, rerun.output
    assert merge_group_states()[-1] == {g: "Cached" for g in GROUPS}  # workers read the cache the first run wrote
    assert f"({len(GROUPS)} groups reused from cache)" in rerun.output
    assert_same_model(target, by_threads)


def test_existing_cluster_by_address(cli, demo, by_threads, tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    ckpt = demo("fsdp2-w2")
    target = tmp_path / "model"
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", local_directory=str(tmp_path / "dask")) as cluster, \
            Client(cluster) as client:
        worker_pids = set(client.run(os.getpid).values())
        since = datetime.now(timezone.utc)
        monkeypatch.chdir(ckpt.run_root.parent)  # paths relative to here, where the workers do not run
        result = cli("promote", ckpt.run_root.name, "--target", target,
                     "--task-runner", "dask", "--dask-address", cluster.scheduler_address)
        assert result.exit_code == 0, result.output
        assert len(client.scheduler_info()["workers"]) == 2  # the cluster outlives the run that used it
    assert {pid for pid, _ in where_groups_ran(since).values()} <= worker_pids
    assert_same_model(target, by_threads)


@pytest.mark.parametrize("flags, message", [
    (["--task-runner", "ray"], "--task-runner ray: choose one of threads, dask"),
    (["--dask-workers", "2"], "apply with --task-runner dask"),
    (["--task-runner", "dask", "--dask-workers", "0"], "--dask-workers 0: give at least 1"),
    (["--task-runner", "dask", "--dask-workers", "2", "--dask-address", "tcp://127.0.0.1:8786"], "give one of them"),
    (["--task-runner", "dask", "--dask-address", "127.0.0.1:8786"], "give the scheduler as tcp://HOST:PORT"),
])
def test_bad_runner_choices_are_refused_in_one_line(cli, demo, tmp_path, flags, message):
    result = cli("promote", demo("fsdp2-w2").run_root, "--target", tmp_path / "model", *flags)
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "model").exists()


def test_a_silent_scheduler_fails_the_run_at_once(prefect_server, cli, demo, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = cli("promote", demo("fsdp2-w2").run_root, "--target", tmp_path / "model", "--task-runner", "dask",
                 "--dask-address", address)
    assert result.exit_code == 2 and f"--dask-address {address}: no Dask scheduler answers" in result.output
    assert "dask scheduler" in result.output and time.monotonic() - started < 20  # Dask alone waits 30 s
    assert not (tmp_path / "model").exists()


def test_s3_to_s3_on_two_workers_each_reads_and_writes_its_share(prefect_server, s3_env, demo, cli, tmp_path,
                                                                  monkeypatch):
    """Workers on other machines share only the object store: each streams its output files to the target
    itself, reading just the ranges of the rank files those files need (whichever files Dask gave it)."""
    from distributed import Client, LocalCluster

    from ckptflow.testing.s3_reads import count_s3_reads, s3_reads
    from helpers import objects, upload

    ckpt = demo("fsdp2-w2-vocab8k")
    source = upload(s3_env, ckpt, "dask-ckpts/d1")
    shards = ("--max-shard-size", "64KB")  # embeddings, head and ~4 files of layers, for two workers to share
    local = cli("promote", ckpt.role_dir, "--target", tmp_path / "local", *shards)  # the thread runner, local
    assert local.exit_code == 0, local.output
    monkeypatch.setenv("CKPTFLOW_RANGE_GAP", "0")  # tiny tensors: by default neighbours come in the same request
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0", local_directory=str(tmp_path / "dask")) as cluster, \
            Client(cluster) as client:
        client.run(count_s3_reads)
        result = cli("promote", source, "--target", "s3://io-models/d1", *shards,
                     "--task-runner", "dask", "--dask-address", cluster.scheduler_address)
        assert result.exit_code == 0, result.output
        reads = list(client.run(s3_reads).values())

    remote = objects(s3_env, "io-models/d1")
    expected = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir() if p.name not in DESCRIBES_THE_RUN}
    assert len([n for n in expected if n.endswith(".safetensors")]) > 4
    assert {n: remote[n] for n in expected} == expected
    assert set(remote) == {*expected, *DESCRIBES_THE_RUN}  # no staging records left
    shares = [sum(n for key, n in fetched.items() if "/model_world_size_" in key) for _, fetched, _ in reads]
    wrote = [{key.rsplit("/", 1)[1] for key in fetched if key.startswith("io-models/d1/model-")} for _, fetched, _ in reads]
    assert all(wrote) and set.union(*wrote) == {n for n in expected if n.endswith(".safetensors")}, wrote  # both worked
    for share, files in zip(shares, wrote):  # however Dask shared the files out, each worker read what its files hold
        needed = rank_bytes_of(ckpt, tmp_path / "local", files)
        assert needed <= share <= needed + ARCHIVE_METADATA, (share, needed, files)
    assert not [key for _, fetched, _ in reads for key in fetched if "/optim_" in key or "/extra_state_" in key]
    assert not [key for _, _, whole in reads for key in whole if "model_world_size" in key]  # ranged GETs only
