"""A promotion that failed mid-merge, retried with the call the Prefect UI's "Retry" button makes, reuses the groups
it finished and publishes the same bytes as an uninterrupted merge.

The UI (prefect-ui-library `WorkspaceFlowRunsApi.retryFlowRun`) posts
`POST /flow_runs/{id}/set_state {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", ...}, "force": true}`;
a worker then executes that same flow run again (`prefect flow-run execute` -> `flow_engine.run_flow`). Here the
run is executed in this process by that engine entry point, as a process worker's child would, against the real
server: a worker would only add the polling.
"""

from __future__ import annotations

import httpx

from mergecore import merge_checkpoint
from mergecore.engine.writer import TensorWriter


def execute(flow, flow_run_id):
    """What a worker's flow-run process does with a scheduled run: load it and run it through the engine."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from ckptflow.flows.settings import in_process_settings

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    with in_process_settings():
        return run_flow(flow, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")


def test_a_ui_retry_resumes_a_failed_promotion(prefect_server, hub, demo, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest
    from helpers import merge_group_states

    ckpt = demo("fsdp2-w2")
    target = tmp_path / "model"
    request = PromotionRequest.of(str(ckpt.run_root), str(target), hub={"repo": "alice/retried", "revision": "step-1"})
    parameters = {"request": request}  # stored as JSON, as the UI's form sends it
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(promote_checkpoint, parameters=parameters)

    write = TensorWriter.write_rows  # every merge writes through it, in row blocks

    def disk_fails_during_layers_1(self, planned, start, tensor):  # the storage under the writer gives out mid-merge
        if planned.group == "layers.1":
            raise RuntimeError("injected fault: the disk went away")
        return write(self, planned, start, tensor)

    monkeypatch.setattr(TensorWriter, "write_rows", disk_fails_during_layers_1)
    assert execute(promote_checkpoint, flow_run.id).is_failed()
    assert not target.exists()
    monkeypatch.setattr(TensorWriter, "write_rows", write)

    reply = httpx.post(f"{PREFECT_API_URL.value()}/flow_runs/{flow_run.id}/set_state", json={
        "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})
    assert reply.status_code in (200, 201) and reply.json()["status"] == "ACCEPT", reply.text
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).state.name == "AwaitingRetry"

    retried = execute(promote_checkpoint, flow_run.id)
    assert retried.is_completed()
    with get_client(sync_client=True) as client:
        again = client.read_flow_run(flow_run.id)
    assert again.state.is_completed() and again.run_count == 2  # the same run, its second attempt

    first, second = merge_group_states()[-2:]
    finished = {g for g, state in first.items() if state == "Completed"}
    assert finished and first["layers.1"] == "Failed"
    assert {g for g, state in second.items() if state == "Cached"} == finished and second["layers.1"] == "Completed"

    uninterrupted = tmp_path / "direct"
    merge_checkpoint(str(ckpt.role_dir), uninterrupted)
    pushed = hub.files("alice/retried", revision="step-1")
    for path in uninterrupted.iterdir():
        if path.name not in ("ckptflow_manifest.json", "README.md"):  # these record how the run went
            assert (target / path.name).read_bytes() == path.read_bytes(), path.name
            assert pushed[path.name] == path.read_bytes(), path.name
