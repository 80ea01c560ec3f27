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


POOLS = Path(__file__).parents[1] / "deployments" / "pools"
GPU_VALUES = {"kubernetes-gpu": {"image": "ghcr.io/acme/ckptflow:1", "target_root_claim": "models"},
              "docker-gpu": {"image": "ghcr.io/acme/ckptflow:1", "volumes": ["/srv/models:/models"]}}


def rendered(template: dict, values: dict) -> dict:
    """The job configuration a worker builds for these deployment values: Prefect's own defaults and templating
    (`from_template_and_values` minus its block look-ups, which need a server), checked by its base model."""
    from prefect.utilities.templating import apply_values
    from prefect.workers.base import BaseJobConfiguration

    defaults = BaseJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    job = apply_values(template["job_configuration"], {**defaults, **values})
    config = BaseJobConfiguration(**job)
    assert config.env["CKPTFLOW_CACHE"] and config.name == "ckptflow"
    return job


@pytest.mark.parametrize("pool", sorted(GPU_VALUES))
def test_gpu_pool_templates_are_valid_work_pools(pool):
    import json

    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools import validate

    template = json.loads((POOLS / f"{pool}.json").read_text())
    WorkPoolCreate(name=f"ckptflow-{pool}", type=pool.split("-")[0], base_job_template=template)
    validate(GPU_VALUES[pool], template["variables"], raise_on_error=True)
    with pytest.raises(Exception):  # the image and the target root's volume have no default: deployments must say
        validate({}, template["variables"], raise_on_error=True)
    job = rendered(template, GPU_VALUES[pool])
    if pool == "kubernetes-gpu":
        pod = job["job_manifest"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == "ghcr.io/acme/ckptflow:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["memory"] == "64Gi"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        assert mounts["target-root"] == "/models" and claims["target-root"] == "models"
    else:
        (request,) = job["container_create_kwargs"]["device_requests"]
        assert request == {"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}
        assert job["volumes"] == ["/srv/models:/models"] and job["image"] == "ghcr.io/acme/ckptflow:1"


def test_the_gpu_deployment_fits_its_pool_template():
    import json

    from prefect.utilities.schema_tools import validate

    template = json.loads((POOLS / "kubernetes-gpu.json").read_text())
    (gpu,) = [d for d in SPEC["deployments"] if d["work_pool"]["name"] == "ckptflow-gpu"]
    variables = {k: v for k, v in gpu["work_pool"]["job_variables"].items()}
    assert set(variables) <= set(template["variables"]["properties"])
    validate({**variables, "image": "x"}, template["variables"], raise_on_error=True)


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
