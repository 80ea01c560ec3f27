"""deployments/prefect.yaml is checked with Prefect's own models and our flow's real signature."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

SPEC = yaml.safe_load((Path(__file__).parents[1] / "deployments" / "prefect.yaml").read_text())


def flow_of(entrypoint: str):
    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_deployment_matches_the_flow(deployment):
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    flow = flow_of(deployment["entrypoint"])
    accepted = set(inspect.signature(flow.fn).parameters)
    required = {n for n, p in inspect.signature(flow.fn).parameters.items() if p.default is inspect.Parameter.empty}
    given = set(deployment.get("parameters", {}))
    assert given <= accepted, given - accepted
    for trigger in deployment.get("triggers", []):
        parsed = DeploymentEventTrigger(**trigger)
        assert parsed.expect == {"checkpoint.uploaded"}
        assert set(trigger["parameters"]) <= accepted and required <= given | set(trigger["parameters"])
    for schedule in deployment.get("schedules", []):
        CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone"))
        assert required <= given
    assert deployment["work_pool"]["name"]


def trigger_parameters(name: str) -> dict:
    (deployment,) = [d for d in SPEC["deployments"] if d["name"] == name]
    (trigger,) = deployment["triggers"]
    return trigger["parameters"]


OPTIONAL = {"step": 1000, "run": "run9", "target": "/models/x", "hub_repo": "acme/x", "revision": "rc-1"}


@pytest.mark.parametrize("given", [(), *[(field,) for field in OPTIONAL], tuple(OPTIONAL)], ids=lambda g: "+".join(g) or "url-only")
def test_trigger_templates_render_with_and_without_each_field(given):
    """Rendered as Prefect's server renders a RunDeployment action: a missing field is None, never an error
    (an undefined field makes the server create no run at all)."""
    import copy

    from prefect.server.events.actions import RunDeployment
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    import datetime
    import uuid

    event = ReceivedEvent(event="checkpoint.uploaded", resource={"prefect.resource.id": "s3://b/ckpt"},
                          payload={field: OPTIONAL[field] for field in given}, id=uuid.uuid4(),
                          occurred=datetime.datetime.now(datetime.timezone.utc))
    parameters = copy.deepcopy(trigger_parameters("promote-on-upload"))
    RunDeployment._upgrade_v1_templates(parameters)
    rendered = hydrate(parameters, HydrationContext(raise_on_error=True, render_jinja=True,
                                                    jinja_context={"event": event}))
    assert rendered == {"checkpoint": "s3://b/ckpt", "event_id": str(event.id),
                        **{field: OPTIONAL[field] if field in given else None for field in OPTIONAL}}
