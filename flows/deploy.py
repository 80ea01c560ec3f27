"""`ckptflow deploy`: the work pool, the deployments of `deployments/prefect.yaml` and their event triggers, applied
to the Prefect API in PREFECT_API_URL so that a second call with the same options changes nothing.

Only what differs from what the server holds is written: a deployment is upserted when one of the fields we set
differs, its trigger automations are replaced when they differ. Deployments on another pool (the GPU ones) are
applied once that pool exists.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import yaml

from mergecore import CheckpointError

from .events import api_url

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "deployments" / "prefect.yaml"
PROCESS_POOL = "ckptflow-process"
BOUNDARY = ("target_root", "hub_org", "checkpoint_root", "revision_pattern")
REQUIRED = {"target_root": "--target-root PATH (where its promotions may land)",
            "checkpoint_root": "--checkpoint-root PATH_OR_URL (where the checkpoints events name may be)"}
_ENV = re.compile(r"\{\{\s*\$(\w+)\s*\}\}")


def with_env(value, env: dict, where: str):
    """`value` with every `{{ $NAME }}` replaced from `env`; a missing variable is a one-line error."""
    if isinstance(value, dict):
        return {k: with_env(v, env, where) for k, v in value.items()}
    if isinstance(value, list):
        return [with_env(v, env, where) for v in value]
    if not isinstance(value, str):
        return value

    def variable(match: re.Match) -> str:
        if match[1] not in env:
            raise CheckpointError(f"{SPEC}: {where} needs ${match[1]}; set that environment variable")
        return env[match[1]]

    return _ENV.sub(variable, value)


def boundary_options(target_root: str | None, hub_org: str | None, checkpoint_root: str | None = None,
                     revision_pattern: str | None = None) -> dict:
    """The checked --target-root and --checkpoint-root (a path made absolute: the worker runs elsewhere; or an
    fsspec URL such as s3://bucket/models, where promotions are published manifest last), --hub-org and
    --revision-pattern (a regular expression; "" removes the deployment's); None where not given.

    >>> boundary_options("s3://b/models/", "acme", "s3://ckpts", r"rc-\\d+")["revision_pattern"]
    'rc-\\\\d+'
    """
    if hub_org is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", hub_org):
        raise CheckpointError(f"--hub-org {hub_org!r} is not a Hub organisation name")
    if revision_pattern:
        try:
            re.compile(revision_pattern)
        except re.error as error:
            raise CheckpointError(f"--revision-pattern {revision_pattern!r} is not a regular expression ({error})") from None
    return {"target_root": _root(target_root), "hub_org": hub_org, "checkpoint_root": _root(checkpoint_root),
            "revision_pattern": revision_pattern}


def _root(root: str | None) -> str | None:
    if root is None or ("://" in root and not root.startswith("file://")):
        return root.rstrip("/") if root else root
    return os.path.abspath(os.path.expanduser(root.removeprefix("file://")))


def apply_deployments(target_root: str | None = None, hub_org: str | None = None, pool: str = PROCESS_POOL,
                      spec_path: Path = SPEC, checkpoint_root: str | None = None,
                      revision_pattern: str | None = None) -> list[str]:
    """Create the process pool and apply the deployments; one line per thing, saying what changed."""
    import httpx

    spec = yaml.safe_load(spec_path.read_text())
    boundary = boundary_options(target_root, hub_org, checkpoint_root, revision_pattern)
    env = {"CKPTFLOW_REPO": str(REPO), "CKPTFLOW_PYTHON": sys.executable, **os.environ}
    url = api_url()
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            lines = [ensure_process_pool(client, pool)]
            for deployment in spec["deployments"]:
                lines.append(apply_one(client, spec, deployment, pool, boundary, env))
            return lines
    except httpx.TransportError as error:
        raise CheckpointError(f"{url}: cannot reach the Prefect API ({type(error).__name__}); start the server or "
                              "fix PREFECT_API_URL") from None


def ensure_process_pool(client, pool: str) -> str:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        found = client.read_work_pool(pool)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        return f"work pool {pool}: created (process)"
    if found.type != "process":
        raise CheckpointError(f"work pool {pool} exists with type {found.type}; pass --pool NAME for a process pool")
    return f"work pool {pool}: unchanged"


def pool_exists(client, name: str) -> bool:
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(name)
        return True
    except ObjectNotFound:
        return False


def flow_of(entrypoint: str):
    module, name = entrypoint.split(":")  # module entrypoints: the installed package, wherever the worker runs
    return getattr(importlib.import_module(module), name)


def apply_one(client, spec: dict, deployment: dict, pool: str, boundary: dict, env: dict) -> str:
    from prefect.exceptions import ObjectNotFound
    from prefect.utilities.callables import parameter_schema

    name = deployment["name"]
    pool_name = deployment["work_pool"]["name"]
    pool_name = pool if pool_name == PROCESS_POOL else pool_name
    if not pool_exists(client, pool_name):
        return f"deployment {name}: skipped, work pool {pool_name} does not exist yet (create it, then deploy again)"
    flow = flow_of(deployment["entrypoint"])
    schema = parameter_schema(flow).model_dump(exclude_unset=True)
    try:
        current = client.read_deployment_by_name(f"{flow.name}/{name}")
    except ObjectNotFound:
        current = None
    parameters = dict(deployment.get("parameters") or {})
    for key in BOUNDARY:
        if key in schema["properties"]:
            value = boundary[key] if boundary[key] is not None else (current.parameters.get(key) if current else None)
            if value not in (None, ""):  # "" given: the deployment's value is removed
                parameters[key] = value
    for key, option in REQUIRED.items():
        if key in schema["properties"] and key not in parameters:
            raise CheckpointError(f"deployment {name} needs a {key.replace('_', ' ')}: pass {option}")
    wanted = {
        "entrypoint": deployment["entrypoint"],
        "description": deployment.get("description"),
        "work_pool_name": pool_name,
        "parameters": parameters,
        "job_variables": with_env(deployment["work_pool"].get("job_variables") or {}, env, name),
        "pull_steps": with_env(deployment.get("pull", spec.get("pull")) or [], env, name),
        "parameter_openapi_schema": schema,
        "enforce_parameter_schema": True,
        "schedules": [(s["cron"], s.get("timezone"), s.get("active", True)) for s in deployment.get("schedules", [])],
    }
    changed = current is None or held(current) != wanted
    if changed:
        deployment_id = client.create_deployment(
            flow_id=client.create_flow_from_name(flow.name), name=name, schedules=schedule_objects(wanted["schedules"]),
            **{k: v for k, v in wanted.items() if k != "schedules"})
    else:
        deployment_id = current.id
    triggers = apply_triggers(client, deployment_id, deployment.get("triggers", []))
    what = "created" if current is None else "updated" if changed else "unchanged"
    return f"deployment {flow.name}/{name}: {what}; triggers {triggers}; pool {pool_name}"


def held(current) -> dict:
    """The fields of a deployment read back from the API that `apply_one` sets, in the same shape."""
    return {
        "entrypoint": current.entrypoint,
        "description": current.description,
        "work_pool_name": current.work_pool_name,
        "parameters": current.parameters,
        "job_variables": current.job_variables or {},
        "pull_steps": current.pull_steps or [],
        "parameter_openapi_schema": current.parameter_openapi_schema,
        "enforce_parameter_schema": current.enforce_parameter_schema,
        "schedules": [(s.schedule.cron, s.schedule.timezone, s.active) for s in current.schedules],
    }


def schedule_objects(schedules: list[tuple]) -> list:
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    return [DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone=timezone), active=active)
            for cron, timezone, active in schedules]


def apply_triggers(client, deployment_id, triggers: list[dict]) -> str:
    """Replace the deployment's automations when they differ from the YAML's triggers; else leave them."""
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

    owner = f"prefect.deployment.{deployment_id}"
    wanted = []
    for trigger in triggers:
        parsed = DeploymentEventTrigger(**trigger)
        parsed.set_deployment_id(deployment_id)
        wanted.append(parsed.as_automation())
    names = {automation.name for automation in wanted}  # the API does not return owner_resource
    held_now = [a for a in client.read_resource_related_automations(owner) if a.name in names]
    if sorted(map(comparable, held_now)) == sorted(map(comparable, wanted)):
        return "unchanged" if wanted else "none"
    client.delete_resource_owned_automations(owner)
    for automation in wanted:
        client.create_automation(automation)
    return f"applied ({len(wanted)})"


def comparable(automation) -> str:
    """An automation as JSON, without the ids the server or the model made up."""
    import json

    data = automation.model_dump(mode="json", include={"name", "description", "enabled", "trigger", "actions"})
    data["trigger"].pop("id", None)
    return json.dumps(data, sort_keys=True)
