"""promote with `engine="vllm"` on a real Prefect server and the loopback Hub: the engine check runs on the
finished folder before it is published (a task of the run, `engine_check`), its row is in the manifest, the card
and the run's equivalence table, and a model vLLM cannot run is neither published nor pushed."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers import engine_processes, require_engine


@pytest.fixture(scope="module")
def vllm():
    return require_engine("vllm")


def task_runs(name: str) -> list:
    """The server's task runs of task `name` (their run names are `name-xyz`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    async def read():
        async with get_client() as client:
            return await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))

    return asyncio.run(read())


def test_promote_proves_the_model_in_vllm_before_it_is_published_and_pushed(vllm, prefect_server, hub, demo, tmp_path):
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest

    ckpt, target = demo("engine-llama"), tmp_path / "model"
    request = PromotionRequest.of(str(ckpt.run_root), str(target), dtype="bf16", engine="vllm",
                                  hub={"repo": "alice/served", "revision": "step-1"})
    state = promote_checkpoint(request, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    [row] = [c for c in result["checks"] if c["check"] == "engine"]
    assert row["ok"] and row["engine"] == "vllm" and row["device"] == "cpu" and row["compared"] > 0
    manifest = json.loads((target / "ckptflow_manifest.json").read_text())
    assert [c for c in manifest["verification"] if c["check"] == "engine"] == [row]
    card = (target / "README.md").read_text()
    assert "| engine | passed |" in card and f"version={row['version']}" in card
    assert hub.files("alice/served", "step-1")["README.md"].decode() == card
    assert [run.state.name for run in task_runs("engine_check")] == ["Completed"]  # a task of the run, before publish
    assert engine_processes() == []


def test_a_model_vllm_cannot_run_is_neither_published_nor_pushed(vllm, prefect_server, hub, demo, cli, tmp_path):
    """The default tiny Qwen2 has a head size of 16, which vLLM's CPU attention lacks: promote ends with the
    engine's one line and exit 4; no folder, no Hub repo."""
    target = tmp_path / "model"
    result = cli("promote", demo("fsdp2-w2").run_root, "--target", target, "--engine", "vllm",
                 "--hub-repo", "alice/unservable")
    assert result.exit_code == 4 and "head size 16" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not target.exists()  # not published (the staging folder stays for a rerun to resume from)
    with pytest.raises(KeyError):
        hub.repo("alice/unservable")
    assert engine_processes() == []
