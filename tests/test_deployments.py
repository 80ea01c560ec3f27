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


def test_promote_latest_is_scheduled_but_inactive_until_configured():
    from prefect.client.schemas.schedules import CronSchedule

    latest = [d for d in SPEC["deployments"] if d["entrypoint"] == "flows/latest.py:promote_latest"]
    assert len(latest) == 1 and latest[0]["schedules"]
    for schedule in latest[0]["schedules"]:
        assert schedule["active"] is False
        assert CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"]).cron == schedule["cron"]
