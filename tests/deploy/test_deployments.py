"""deployments/prefect.yaml is checked with Prefect's own models and our flow's real signature."""

from __future__ import annotations

from helpers import REPO
import importlib
import inspect
from pathlib import Path

import pytest
import yaml

SPEC = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())


def flow_of(entrypoint: str):
    module, name = entrypoint.split(":")  # module entrypoints: the installed package, wherever the worker runs
    return getattr(importlib.import_module(module), name)


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


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_deployment_parameters_are_what_the_flow_takes(deployment):
    """The server's own check of a deployment's parameters (`ckptflow deploy` enforces the schema), and, where
    they are the whole of a run's (a schedule's; a trigger's with an event's fields), the flow's check: the
    request or settings they hold build, every value passing the library's rules."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    flow = flow_of(deployment["entrypoint"])
    parameters = deployment.get("parameters", {})
    validate(parameters, parameter_schema(flow).model_dump(exclude_unset=True), raise_on_error=True,
             ignore_required=True)
    complete = [dict(parameters)] if deployment.get("schedules") else []
    for _ in deployment.get("triggers", []):
        complete.append({**parameters, "checkpoint": "s3://b/run1/global_step_7/actor", "target_root": "/models",
                         "checkpoint_root": "s3://b"})
    for run in complete:
        checked = flow.validate_parameters(run)
        for name in ("request", "settings"):
            if name in parameters:
                assert checked[name].model_dump(exclude_unset=True) == parameters[name]  # none dropped on the way


def test_promote_latest_is_scheduled_but_inactive_until_configured():
    from prefect.client.schemas.schedules import CronSchedule

    latest = [d for d in SPEC["deployments"] if d["entrypoint"] == "ckptflow.flows.latest:promote_latest"]
    assert len(latest) == 1 and latest[0]["schedules"]
    for schedule in latest[0]["schedules"]:
        assert schedule["active"] is False
        assert CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"]).cron == schedule["cron"]


POOLS = REPO / "deployments" / "pools"
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
    # each run is a fresh container: the config check's answers live on the target root's volume, so only a
    # cluster's first checkpoint of a config pays transformers' imports (seconds), not every event
    assert job["env"]["CKPTFLOW_CONFIG_CACHE"].startswith("/models/")
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


GPU_ENV = {"CKPTFLOW_IMAGE_NAME": "ghcr.io/acme/ckptflow", "CKPTFLOW_IMAGE_TAG": "1-cuda"}


def gpu_deployment() -> dict:
    (gpu,) = [d for d in SPEC["deployments"] if d["name"] == "promote-gpu"]
    return gpu


def test_the_gpu_deployment_builds_and_pushes_the_cuda_variant_of_the_containerfile(monkeypatch):
    """`prefect deploy --name promote-gpu` builds deployments/image/Containerfile with TORCH=cuda, pushes that
    tag, and the pool's jobs run the very image pushed, from the folder the image holds the sources in."""
    import inspect
    import re

    from docker.api.build import BuildApiMixin
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.utilities.templating import apply_values

    PrefectYamlModel(**SPEC)  # what `prefect deploy` reads the file with
    gpu = gpu_deployment()
    (build,) = gpu["build"]
    step = build["prefect_docker.deployments.steps.build_docker_image"]
    containerfile = REPO / step["dockerfile"]
    assert step["dockerfile"] == "deployments/image/Containerfile" and containerfile.is_file()
    text = containerfile.read_text()
    # prefect-docker hands the extra keys to docker-py's build(): they must be its parameters.
    extra = set(step) - {"id", "requires", "image_name", "tag", "dockerfile"}
    assert extra == {"buildargs"} and extra <= set(inspect.signature(BuildApiMixin.build).parameters)
    assert step["buildargs"] == {"TORCH": "cuda"}
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert set(step["buildargs"]) <= declared and {"BASE", "PIP_CERT", "PIP_FIND_LINKS", "PIP_INDEX_URL"} <= declared
    assert re.search(r"^\s+cuda\) ", text, re.M)  # the variant the build argument selects
    (push,) = gpu["push"]
    pushed = push["prefect_docker.deployments.steps.push_docker_image"]
    assert (pushed["image_name"], pushed["tag"]) == ("{{ build-image.image_name }}", "{{ build-image.tag }}")
    for name, value in GPU_ENV.items():  # Prefect fills `{{ $NAME }}` from the environment of `prefect deploy`
        monkeypatch.setenv(name, value)
    built = apply_values(step, {})
    image = apply_values(gpu["work_pool"]["job_variables"]["image"], {})
    assert image == f"{built['image_name']}:{built['tag']}" == "ghcr.io/acme/ckptflow:1-cuda"
    (pull,) = gpu["pull"]
    workdir = pull["prefect.deployments.steps.set_working_directory"]["directory"]
    # the entrypoint is a module of the installed package: the image copies its folder and installs it
    package = gpu["entrypoint"].split(":")[0].rpartition(".")[0]
    folder = {"ckptflow.flows": "flows"}[package]
    assert f"COPY {folder} {workdir}/{folder}" in text and 'pip install ".[pipeline' in text
    assert f"WORKDIR {workdir}" in text


def test_the_build_context_keeps_what_the_containerfile_copies():
    """.dockerignore (read by docker and podman) sends only the sources: every COPY source stays included."""
    import re

    text = (REPO / "deployments" / "image" / "Containerfile").read_text()
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    sources = {src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M) for src in line.split()}
    assert sources and {f"!{src}" for src in sources} <= set(ignore)
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"  # everything else (.venv, .git, demo) is left out
