"""`ckptflow watch` against a real Prefect server: a copy in progress is never announced, a complete one once,
and a restart with the same state announces nothing again. Events are read back from the server's own API."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def events_about(resource_prefix: str, expect: int, wait_s: float = 20.0) -> list[dict]:
    """`checkpoint.uploaded` events whose resource id starts with `resource_prefix`, as the server stored them
    (the server persists events in batches: wait until `expect` are there, or `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        reply = httpx.post(f"{api_url()}/events/filter", json={"filter": {
            "event": {"name": ["checkpoint.uploaded"]},
            "resource": {"id_prefix": [resource_prefix]}}, "limit": 50})
        reply.raise_for_status()
        found = reply.json()["events"]
        if len(found) >= expect or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def copy_tree(source: Path, dest: Path, keep=lambda rel: True) -> None:
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if path.is_file() and keep(rel):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)


def test_a_copy_in_progress_is_announced_once_when_complete(prefect_server, demo, cli, tmp_path):
    original = demo("fsdp2-w2").run_root
    root = tmp_path / "uploads"
    state = tmp_path / "watch-state.json"
    watch = lambda: cli("watch", root, "--once", "--state", state)  # noqa: E731

    # rank 1 not there yet, rank 0 half written
    copy_tree(original, root / "run1", lambda rel: "_rank_1" not in rel and not rel.startswith("reference/"))
    rank0 = next(root.rglob("model_world_size_2_rank_0.pt"))
    whole = rank0.read_bytes()
    rank0.write_bytes(whole[: len(whole) // 2])
    for _ in range(2):
        result = watch()
        assert result.exit_code == 0, result.output
        assert "announced" not in result.output
    copy_tree(original, root / "run1", lambda rel: "_rank_1" in rel)  # every file there, rank 0 still growing
    assert "announced" not in watch().output
    rank0.write_bytes(whole)
    assert "announced" not in watch().output  # complete, but not yet seen unchanged twice
    role = rank0.parent
    result = watch()
    assert result.exit_code == 0 and f"announced {role}" in result.output
    assert "announced" not in watch().output

    from ckptflow.flows.watch import Watcher

    assert Watcher(str(root), api_url(), state).poll_once() == []  # a restart with the same state
    stored = events_about(str(root), expect=1)
    assert [e["resource"]["prefect.resource.id"] for e in stored] == [str(role)]
    assert stored[0]["payload"]["step"] == 1 and stored[0]["resource"]["ckptflow.run"] == "run1"
    time.sleep(1.5)  # nothing more arrives late
    assert len(events_about(str(root), expect=2, wait_s=0)) == 1


def test_unreachable_server_and_foreign_state_are_one_line_errors(demo, cli, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    copy_tree(demo("fsdp2-w2").run_root, tmp_path / "up" / "run1", lambda rel: not rel.startswith("reference/"))
    state = tmp_path / "state.json"
    monkeypatch.setenv("CKPTFLOW_EVENTS_RETRIES", "0")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert cli("watch", tmp_path / "up", "--once", "--state", state).exit_code == 0  # first look: sizes only
        result = cli("watch", tmp_path / "up", "--once", "--state", state)
        assert result.exit_code == 2 and "cannot reach the Prefect API" in result.output
        assert len(result.output.strip().splitlines()) == 1
        other = cli("watch", tmp_path, "--once", "--state", state)
        assert other.exit_code == 2 and "--state" in other.output and str(state) in other.output
