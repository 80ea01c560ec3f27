"""`checkpoint.uploaded` events: what a training job (or `ckptflow watch`) sends when a checkpoint is complete.

The resource id is the checkpoint URL; the run name and step ride along as resource labels and payload, derived
from verl's layout (`.../<run>/global_step_<N>/<role>`) when not given.

>>> event = checkpoint_event("s3://ckpts/run1/global_step_1000/actor")
>>> event["resource"]["ckptflow.run"], event["payload"]["step"]
('run1', 1000)
"""

from __future__ import annotations

import datetime
import re
import uuid
from dataclasses import dataclass

from mergecore import CheckpointError, MergeTarget
from mergecore.request import checked_path
from mergecore.storage.retries import Retries

EVENT = "checkpoint.uploaded"
_STEP_FOLDER = re.compile(r"^global_step_(\d+)$")
_TITAN_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def step_and_run(checkpoint: str) -> tuple[int | None, str | None]:
    """(step, run name) from a checkpoint path: verl's `global_step_N` folder and the one above it, or torchtitan's
    `step-N` folder and the one above its `checkpoint/`.

    >>> step_and_run("s3://ckpts/run1/global_step_7/actor"), step_and_run("/runs/llama/checkpoint/step-300")
    ((7, 'run1'), (300, 'llama'))
    """
    parts = [p for p in re.split(r"[/\\]+", checkpoint.split("://", 1)[-1]) if p]
    for i in range(len(parts) - 1, -1, -1):
        match = _STEP_FOLDER.match(parts[i])
        if match:
            return int(match[1]), (parts[i - 1] if i > 0 else None)
        titan = _TITAN_STEP_FOLDER.match(parts[i])
        if titan and i > 0 and parts[i - 1] == "checkpoint":
            return int(titan[1]), (parts[i - 2] if i > 1 else None)
    return None, (parts[-1] if parts else None)


@dataclass(frozen=True)
class UploadedCheckpoint:
    """What a `checkpoint.uploaded` event says, checked by type and form when built: by the sender
    (`checkpoint_event`) and first thing by the receiver (`flows.service.event_place`), before anything reads it.
    Prefect fills the flow's parameters from the event's JSON, so any JSON value may arrive in any field.

    >>> UploadedCheckpoint("s3://ckpts/run1/global_step_7/actor", step="7").step
    7
    >>> UploadedCheckpoint("s3://ckpts/run1/global_step_7/actor", step=-1)
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: event step -1: give a non-negative whole number, or leave it out (it is read from global_step_N)
    """

    checkpoint: str
    step: int | None = None
    run: str | None = None
    target: str | None = None
    hub_repo: str | None = None
    revision: str | None = None

    def __post_init__(self):
        checked_path(self.checkpoint, "event checkpoint")
        object.__setattr__(self, "step", _event_step(self.step))
        for name in ("run", "hub_repo", "revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
                raise CheckpointError(f"event {name} {value!r}: give a non-empty string without NUL bytes, or leave "
                                      "it out")
        if self.target is not None:
            MergeTarget(self.target)  # the form of every target: a path, never one of ckptflow's own folders


def _event_step(value) -> int | None:
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}", value):  # as a template may render it
        return int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise CheckpointError(f"event step {value!r}: give a non-negative whole number, or leave it out (it is read "
                              "from global_step_N)")
    return value


def checkpoint_event(checkpoint: str, step: int | None = None, run: str | None = None, **payload) -> dict:
    """One `checkpoint.uploaded` event, as `POST /api/events` takes it; None-valued payload fields are left out."""
    step = UploadedCheckpoint(checkpoint, step, run, **payload).step
    found_step, found_run = step_and_run(checkpoint)
    step = found_step if step is None else step
    run = run or found_run
    resource = {"prefect.resource.id": checkpoint}
    if run:
        resource["ckptflow.run"] = run
    if step is not None:
        resource["ckptflow.step"] = str(step)
    body = {"step": step, "run": run, **payload}
    return {
        "id": str(uuid.uuid4()),
        "event": EVENT,
        "occurred": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "resource": resource,
        "payload": {k: v for k, v in body.items() if v is not None},
    }


def api_url() -> str:
    """PREFECT_API_URL (environment or profile): events and deployments need a server that stays up."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise CheckpointError("PREFECT_API_URL is not set: start a server (`prefect server start`) and export "
                              "PREFECT_API_URL=http://127.0.0.1:4200/api; a temporary server would lose the events")
    return url


def post_events(api_url: str, events: list[dict], retries: Retries | None = None, timeout_s: float = 10.0) -> None:
    """POST events to a Prefect API (`PREFECT_API_URL`), retrying connection errors and 5xx/429; anything
    else, or a server that never answers, is a one-line CheckpointError."""
    import httpx

    retries = retries or Retries.from_env("CKPTFLOW_EVENTS", 3, 0.5)
    url = api_url.rstrip("/") + "/events"

    def send():
        reply = httpx.post(url, json=events, timeout=timeout_s)
        reply.raise_for_status()

    def wait_after(error: Exception, attempt: int) -> float | None:
        status = getattr(getattr(error, "response", None), "status_code", None)
        transient = isinstance(error, httpx.TransportError) or status == 429 or (status or 0) >= 500
        return retries.delay(attempt) if transient else None

    try:
        retries.call(send, wait_after)
    except httpx.HTTPStatusError as error:
        raise CheckpointError(f"{url}: the Prefect API refused the event (HTTP {error.response.status_code}: "
                              f"{error.response.text[:200]}); check PREFECT_API_URL") from None
    except httpx.TransportError as error:
        raise CheckpointError(f"{url}: cannot reach the Prefect API ({type(error).__name__}: {error}); start the "
                              "server or fix PREFECT_API_URL") from None


def promotion_place(target_root: str, hub_org: str | None, run: str, step: int | None) -> dict:
    """Where a promotion of (run, step) lands: `{root}/{run}/step-{N}` and the Hub repo `{org}/{run}`, branch
    `step-{N}` (no Hub push without an organisation). Events and schedules use this one rule.

    >>> promotion_place("/models", "acme", "run1", 1000)
    {'target': '/models/run1/step-1000', 'hub_repo': 'acme/run1', 'revision': 'step-1000'}
    """
    if not run or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", run) or ".." in run:
        raise CheckpointError(f"run name {run!r} cannot name a folder or a Hub repo; pass --run with letters, digits, '.', '_' or '-'")
    leaf = step_branch(step)
    return {"target": f"{target_root.rstrip('/')}/{run}/{leaf}",
            "hub_repo": f"{hub_org}/{run}" if hub_org else None,
            "revision": leaf if hub_org else None}


def step_branch(step: int | None) -> str:
    """The folder and Hub branch name of a step: `step-N`, or `latest` when the step is unknown.

    >>> step_branch(1000), step_branch(None)
    ('step-1000', 'latest')
    """
    return f"step-{step}" if step is not None else "latest"


def triggered_run(event: dict, find_timeout_s: float = 60.0, poll_s: float = 0.5):
    """The flow run an automation created for `event` (its `event_id` parameter, which the trigger templates
    fill from `{{ event.id }}`); a one-line CheckpointError when none appears within `find_timeout_s`."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterExpectedStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    occurred = datetime.datetime.fromisoformat(event["occurred"])
    recent = FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(
        after_=occurred - datetime.timedelta(minutes=5)))
    deadline = time.monotonic() + find_timeout_s
    with get_client(sync_client=True) as client:
        while True:
            for run in client.read_flow_runs(flow_run_filter=recent, sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                                             limit=200):
                if (run.parameters or {}).get("event_id") == event["id"]:
                    return run
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"no flow run was created for event {event['id']} within {find_timeout_s:.0f} s: apply the "
                    "deployment (`ckptflow deploy`), check its trigger is enabled and the server log")
            time.sleep(poll_s)


def follow_run(run_id, timeout_s: float | None = None, poll_s: float = 1.0, on_state=None):
    """The flow run once it reaches a final state (Completed, Failed, Crashed, Cancelled); `on_state(run)` is
    called at each new state. A one-line CheckpointError after `timeout_s`."""
    import time

    from prefect.client.orchestration import get_client

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    seen = None
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(run_id)
            if run.state and run.state.name != seen:
                seen = run.state.name
                if on_state:
                    on_state(run)
            if run.state and run.state.is_final():
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointError(f"flow run {run.name} ({run.id}) still {seen} after {timeout_s:.0f} s; is a "
                                      f"worker polling its work pool ({run.work_pool_name})?")
            time.sleep(poll_s)
