"""Promotion on events: what an event may ask for (unit level), then the whole service on a real Prefect server."""

from __future__ import annotations

from helpers import REPO
import os
import re

import pytest

from ckptflow.flows.service import (allowed_revision, event_place, inside_checkpoint_root, inside_org, inside_root,
                           promote_uploaded)
from mergecore import CheckpointError

CKPT = "s3://ckpts/run1/global_step_1000/actor"


def test_an_event_with_only_the_checkpoint_lands_under_the_root_and_org(tmp_path):
    assert event_place(CKPT, str(tmp_path), "acme") == {
        "target": f"{tmp_path}/run1/step-1000", "hub_repo": "acme/run1", "revision": "step-1000"}


def test_no_org_means_no_hub_push(tmp_path):
    assert event_place(CKPT, str(tmp_path), None)["hub_repo"] is None


def test_the_event_may_choose_inside_the_boundary(tmp_path):
    place = event_place(CKPT, str(tmp_path), "acme", step=5, run="other", target="mine/x", hub_repo="acme/mine",
                        revision="rc-1", revision_pattern=r"rc-\d+")
    assert place == {"target": f"{tmp_path}/mine/x", "hub_repo": "acme/mine", "revision": "rc-1"}
    assert event_place(CKPT, str(tmp_path), "acme", run="other")["target"] == f"{tmp_path}/other/step-1000"
    assert event_place(CKPT, str(tmp_path), "acme", hub_repo="acme/x")["revision"] == "step-1000"


@pytest.mark.parametrize("target", ["/etc/passwd-dir", "{root}/../escape", "../escape", "{root}", "s3://bucket/x",
                                    "file:///tmp"])
def test_targets_outside_the_root_are_refused(tmp_path, target):
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(CheckpointError, match="outside this deployment's target root"):
        event_place(CKPT, str(root), "acme", target=target.format(root=root))


def test_a_symlink_inside_the_root_that_leads_out_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside"):
        inside_root(str(root / "link" / "model"), str(root))
    assert inside_root(str(root / "real" / "model"), str(root)) == str(root / "real" / "model")


def test_deploy_takes_a_path_or_an_object_store_root(tmp_path, monkeypatch):
    from ckptflow.flows.deploy import boundary_options

    monkeypatch.chdir(tmp_path)
    assert boundary_options("models", "acme") == {"target_root": str(tmp_path / "models"), "hub_org": "acme",
                                                  "checkpoint_root": None, "revision_pattern": None}
    assert boundary_options("s3://bucket/models/", None)["target_root"] == "s3://bucket/models"
    with pytest.raises(CheckpointError, match="not a Hub organisation"):
        boundary_options(None, "acme/../x")


def test_url_roots_compare_normalised_paths():
    assert inside_root("s3://b/models/r/x", "s3://b/models") == "s3://b/models/r/x"
    assert inside_root("r/x", "s3://b/models/") == "s3://b/models/r/x"
    for target in ["s3://b/models/../x", "s3://b/models-other/x", "s3://c/models/x", "/models/x", "s3://b/models"]:
        with pytest.raises(CheckpointError, match="outside"):
            inside_root(target, "s3://b/models")


@pytest.mark.parametrize("repo", ["evil/run1", "acme", "acme/../evil/x", "acme/a/b", "acmex/run1", "/acme/run1"])
def test_repos_outside_the_org_are_refused(repo):
    with pytest.raises(CheckpointError, match="outside this deployment's Hub organisation acme"):
        inside_org(repo, "acme")


def test_a_repo_without_an_org_is_refused():
    with pytest.raises(CheckpointError, match="no Hub organisation"):
        inside_org("acme/run1", None)


def test_a_deployment_without_a_root_refuses_every_event():
    with pytest.raises(CheckpointError, match="ckptflow deploy --target-root"):
        event_place(CKPT, None, "acme")


def test_a_bad_revision_or_run_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a branch name"):
        event_place(CKPT, str(tmp_path), "acme", revision="../main", revision_pattern=".*")
    with pytest.raises(CheckpointError, match="run name"):
        event_place(CKPT, str(tmp_path), "acme", run="../evil")


def test_the_flow_refuses_before_reading_or_writing_anything(tmp_path):
    root = tmp_path / "root"
    boundary = {"target_root": str(root), "hub_org": "acme", "checkpoint_root": str(tmp_path)}
    with pytest.raises(CheckpointError, match="outside"):
        promote_uploaded.fn(str(tmp_path / "no-such-checkpoint"), target=str(tmp_path / "elsewhere"), **boundary)
    with pytest.raises(CheckpointError, match="Hub organisation acme"):
        promote_uploaded.fn(str(tmp_path / "no-such-checkpoint"), hub_repo="evil/x", **boundary)
    with pytest.raises(CheckpointError, match="checkpoint '/etc/passwd' is outside"):
        promote_uploaded.fn("/etc/passwd", **boundary)
    with pytest.raises(CheckpointError, match="refused: this deployment lets events push to only step-1000"):
        promote_uploaded.fn(f"{tmp_path}/run1/global_step_1000/actor", revision="main", **boundary)
    with pytest.raises(CheckpointError, match="no checkpoint root"):
        promote_uploaded.fn(str(tmp_path / "no-such-checkpoint"), target_root=str(root), hub_org="acme")
    assert os.listdir(tmp_path) == []


# --- the branch rule (the Hub revisions an event may push to) and the source boundary (checkpoints below the root)

@pytest.mark.parametrize("revision", ["main", "refs/heads/main", "refs/pr/1", "refs/heads/step-1000", "step-999",
                                      "step-1000/../main", "latest"])
def test_an_event_may_not_pick_another_branch_by_default(revision):
    with pytest.raises(CheckpointError, match="refused|not a branch name"):
        allowed_revision(revision, 1000)


@pytest.mark.parametrize("revision", ["refs/heads/main", "refs/pr/1", "refs/heads/rc-1", "refs/tags/rc-1"])
def test_refs_are_refused_whatever_the_pattern(revision):
    with pytest.raises(CheckpointError, match="never refs/"):
        allowed_revision(revision, 1000, ".*")


def test_the_derived_branch_and_what_the_pattern_allows_pass():
    assert allowed_revision(None, 1000) == "step-1000" == allowed_revision("step-1000", 1000)
    assert allowed_revision(None, None) == "latest"
    assert allowed_revision("rc-2", 1000, r"rc-\d+") == "rc-2"
    with pytest.raises(CheckpointError, match=re.escape("or a branch matching 'rc-\\d+'")):
        allowed_revision("rc-2x", 1000, r"rc-\d+")  # a full match, not a prefix
    with pytest.raises(CheckpointError, match="refused"):
        allowed_revision("main", 1000, r"rc-\d+")


def test_an_event_naming_main_through_the_hub_repo_is_refused_too(tmp_path):
    """The branch rule holds whichever way the repo is chosen (derived or named by the event)."""
    for hub_repo in (None, "acme/run1"):
        with pytest.raises(CheckpointError, match="refused"):
            event_place(CKPT, str(tmp_path), "acme", hub_repo=hub_repo, revision="main")
    no_step = event_place("s3://ckpts/loose-folder", str(tmp_path), "acme", hub_repo="acme/x")
    assert no_step["revision"] == "latest"  # never None: that would push to the repo's main


@pytest.fixture
def sources(tmp_path):
    """A checkpoint root with one checkpoint, a folder beside it and a link inside it that leads out."""
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    (root / "run1" / "global_step_1" / "actor").mkdir(parents=True)
    (outside / "global_step_1" / "actor").mkdir(parents=True)
    (root / "escape").symlink_to(outside)
    return root, outside


def test_a_checkpoint_below_the_root_passes_resolved(sources):
    root, _ = sources
    checkpoint = root / "run1" / "global_step_1" / "actor"
    assert inside_checkpoint_root(str(checkpoint), str(root)) == str(checkpoint)
    assert inside_checkpoint_root(f"file://{checkpoint}", str(root)) == str(checkpoint)
    assert inside_checkpoint_root("run1/./global_step_1/actor", str(root)) == str(checkpoint)
    assert inside_checkpoint_root(f"{root}/run1/../run1/global_step_1/actor", str(root)) == str(checkpoint)


@pytest.mark.parametrize("checkpoint", ["/etc/passwd", "/etc", "{root}/../elsewhere/global_step_1/actor",
                                        "../elsewhere/global_step_1/actor", "{root}/escape/global_step_1/actor",
                                        "{root}-other/run1", "s3://ckpts/run1/global_step_1/actor",
                                        "file:///etc/passwd"])
def test_checkpoints_outside_a_local_root_are_refused(sources, checkpoint):
    root, _ = sources
    with pytest.raises(CheckpointError, match="outside this deployment's checkpoint root"):
        inside_checkpoint_root(checkpoint.format(root=root), str(root))


@pytest.mark.parametrize("checkpoint", ["s3://other-bucket/run1/global_step_1/actor", "s3://ckpts-x/run1",
                                        "s3://ckpts/runs/../secret/actor", "s3://ckpts/runs-old/run1", "gs://ckpts/runs/a",
                                        "/etc/passwd", "file:///etc/passwd", "s3://ckpts/secret"])
def test_checkpoints_outside_a_url_root_are_refused(checkpoint):
    with pytest.raises(CheckpointError, match="outside this deployment's checkpoint root"):
        inside_checkpoint_root(checkpoint, "s3://ckpts/runs")
    assert inside_checkpoint_root("s3://ckpts/runs/run1/global_step_1/actor", "s3://ckpts/runs") == \
        "s3://ckpts/runs/run1/global_step_1/actor"


def test_a_deployment_without_a_checkpoint_root_refuses_every_checkpoint():
    with pytest.raises(CheckpointError, match="--checkpoint-root"):
        inside_checkpoint_root(CKPT, None)


def test_deploy_checks_the_revision_pattern_and_normalises_the_checkpoint_root(tmp_path, monkeypatch):
    from ckptflow.flows.deploy import boundary_options

    monkeypatch.chdir(tmp_path)
    given = boundary_options(None, None, "ckpts/", r"rc-\d+")
    assert given["checkpoint_root"] == str(tmp_path / "ckpts") and given["revision_pattern"] == r"rc-\d+"
    assert boundary_options(None, None, "s3://ckpts/runs/")["checkpoint_root"] == "s3://ckpts/runs"
    with pytest.raises(CheckpointError, match="not a regular expression"):
        boundary_options(None, None, None, "rc-(")


# --- the whole service: a real `prefect server`, `ckptflow deploy`, a process worker, the loopback Hub ---------

import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers import free_port  # noqa: E402

PREFECT = Path(sys.executable).with_name("prefect")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group the test started, SIGKILL if it lingers."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


@contextlib.contextmanager
def started(command: list[str], env: dict, log: Path):
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=REPO)
        try:
            yield process
        finally:
            stop(process)


def wait_for_health(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"prefect server did not answer in {timeout_s} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Server, deployments (target root + org acme), worker and Hub, all on loopback; everything stopped after."""
    from hub_server import HubServer

    home = tmp_path_factory.mktemp("service")
    root = home / "models"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    with HubServer(tokens={"hf_alice": "alice"}, orgs={"acme": {"alice"}}) as hub:
        env = {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": api,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO", "PYTHONPATH": str(REPO),
               "HF_ENDPOINT": hub.url, "HF_HOME": str(home / "hf"), "HF_HUB_DISABLE_XET": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "hf_alice"}
        for name in ("PREFECT_PROFILES_PATH", "PREFECT_TEST_MODE", "PREFECT_API_KEY"):
            env.pop(name, None)
        with started([str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                     home / "server.log") as server:
            wait_for_health(api, server, home / "server.log")
            yield {"api": api, "env": env, "root": root, "hub": hub, "home": home,
                   "sources": tmp_path_factory.getbasetemp()}  # the demo checkpoints and the watched folder


def ckptflow(service, *args, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", *map(str, args)], env=service["env"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


@contextlib.contextmanager
def api_client(service):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: service["api"]}), get_client(sync_client=True) as client:
        yield client


def snapshot(service) -> str:
    """Deployments, pools and automations as read back from the API."""
    with api_client(service) as client:
        deployments = [d.model_dump(mode="json") for d in client.read_deployments()]
        pools = [p.model_dump(mode="json") for p in client.read_work_pools()]
        automations = [a.model_dump(mode="json") for a in client.read_automations()]
    return json.dumps({"deployments": deployments, "pools": pools, "automations": automations}, sort_keys=True)


def test_deploy_twice_changes_nothing(service):
    first = ckptflow(service, "deploy", "--target-root", service["root"], "--hub-org", "acme", "--checkpoint-root",
                     service["sources"])
    assert first.returncode == 0, first.stderr
    assert "promote-uploaded/promote-on-upload: created; triggers applied (1)" in first.stdout
    before = snapshot(service)
    second = ckptflow(service, "deploy")  # the root and org stay what the deployment has
    assert second.returncode == 0, second.stderr
    assert "promote-uploaded/promote-on-upload: unchanged; triggers unchanged" in second.stdout
    assert snapshot(service) == before
    with api_client(service) as client:
        deployment = client.read_deployment_by_name("promote-uploaded/promote-on-upload")
    assert deployment.parameters["target_root"] == str(service["root"]) and deployment.parameters["hub_org"] == "acme"
    assert deployment.parameters["checkpoint_root"] == str(service["sources"])
    assert "revision_pattern" not in deployment.parameters  # only the derived step-N branch
    assert_one_process_per_flow_run(service)


def assert_one_process_per_flow_run(service) -> None:
    """The process pool's deployments name the engine command, in the interpreter `ckptflow deploy` ran in: without
    one, Prefect's process worker starts a workspace supervisor first (a second Python start-up and Prefect import,
    ~1.2 s of every event)."""
    with api_client(service) as client:
        on_process_pool = [d for d in client.read_deployments() if d.work_pool_name == "ckptflow-process"]
    assert len(on_process_pool) == 3
    for deployment in on_process_pool:
        assert deployment.job_variables["command"] == f"{sys.executable} -m prefect.engine", deployment.name


def test_deploy_without_a_server_url_is_one_line():
    result = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "deploy"], cwd=REPO, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} |
                            {"PYTHONPATH": str(REPO), "PREFECT_HOME": "/nonexistent-prefect-home"}, timeout=60)
    assert result.returncode == 2 and "PREFECT_API_URL is not set" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_notify_an_unreachable_server_is_one_line():
    dead = f"http://127.0.0.1:{free_port()}/api"
    result = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "notify", CKPT], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": dead,
                                                        "CKPTFLOW_EVENTS_RETRIES": "1", "CKPTFLOW_EVENTS_BACKOFF": "0.1"})
    assert result.returncode == 2 and "cannot reach the Prefect API" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def run_for(service, event: dict):
    from ckptflow.flows.events import triggered_run

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: service["api"]}):
        return triggered_run(event, find_timeout_s=30, poll_s=0.2)


def test_events_with_and_without_each_optional_field_each_create_a_run(service):
    from ckptflow.flows.events import checkpoint_event, post_events

    optional = {"target": f"{service['root']}/x", "hub_repo": "acme/x", "revision": "rc-1"}
    events = [checkpoint_event("/nowhere/checkpoint")]  # no step, no run: only the resource id
    events += [checkpoint_event("/nowhere/run7/global_step_3/actor")]  # step and run derived by the sender
    events += [checkpoint_event("/nowhere/checkpoint", **{field: value}) for field, value in optional.items()]
    events += [checkpoint_event("/nowhere/checkpoint", step=4, run="r", **optional)]
    post_events(service["api"], events)
    with api_client(service) as client:
        for event in events:
            run = run_for(service, event)
            for field in ("step", "run", "target", "hub_repo", "revision"):
                assert run.parameters[field] == event["payload"].get(field), (field, event)
            assert run.parameters["checkpoint"] == event["resource"]["prefect.resource.id"]
            client.delete_flow_run(run.id)  # no worker runs yet: these runs are only proof of creation


def test_notify_promotes_and_a_repeat_is_a_cache_hit_and_the_boundary_holds(service, demo):
    from ckptflow.flows.events import checkpoint_event, follow_run, post_events

    from prefect.settings import PREFECT_API_URL, temporary_settings

    checkpoint = demo("fsdp2-w1").role_dir  # .../global_step_1/actor below the fixture's run root
    outside = service["home"] / "outside"
    refused = {"target root": checkpoint_event(str(checkpoint), target=f"{service['root']}/../outside/model"),
               "Hub organisation acme": checkpoint_event(str(checkpoint), hub_repo="evil/model"),
               "checkpoint root": checkpoint_event("/etc/passwd", step=1, run="passwd"),
               "push to only step-1": checkpoint_event(str(checkpoint), revision="main")}
    hub = service["hub"]
    deployed = ckptflow(service, "deploy", "--target-root", service["root"], "--hub-org", "acme",
                        "--checkpoint-root", service["sources"])  # idempotent
    assert deployed.returncode == 0, deployed.stderr
    with started([str(PREFECT), "worker", "start", "--pool", "ckptflow-process", "--type", "process"],
                 service["env"], service["home"] / "worker.log"):
        first = ckptflow(service, "notify", checkpoint, "--wait", "--timeout", 150, timeout_s=180)
        assert first.returncode == 0, first.stdout + first.stderr + (service["home"] / "worker.log").read_text()[-3000:]
        step, run = 1, checkpoint.parent.parent.name
        target = service["root"] / run / f"step-{step}"
        assert f"verified model: {target}" in first.stdout and f"acme/{run}" in first.stdout
        assert json.loads((target / "ckptflow_manifest.json").read_text())  # published atomically, with its manifest
        files = hub.files(f"acme/{run}", revision=f"step-{step}")
        for path in target.iterdir():
            if path.is_file():
                assert files[path.name] == path.read_bytes(), path.name
        commits = len(hub.commits(f"acme/{run}", branch=f"step-{step}"))

        second = ckptflow(service, "notify", checkpoint, "--wait", "--timeout", 150, timeout_s=180)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "groups reused from cache" in second.stdout and "unchanged, no new commit" in second.stdout
        assert len(hub.commits(f"acme/{run}", branch=f"step-{step}")) == commits

        main_commits = len(hub.commits(f"acme/{run}", branch="main"))
        post_events(service["api"], list(refused.values()))

        with temporary_settings({PREFECT_API_URL: service["api"]}):
            for why, event in refused.items():
                finished = follow_run(run_for(service, event).id, timeout_s=120, poll_s=0.3)
                assert finished.state.is_failed() and why in finished.state.message, finished.state.message
        watched_model = watch_a_slow_copy_then_wait_for_its_promotion(service, demo("fsdp2-w1").run_root)
    assert not outside.exists() and not any("evil" in request.path for request in hub.requests)
    assert not (service["root"] / "passwd").exists() and main_commits == len(hub.commits(f"acme/{run}", branch="main"))
    assert_same_tensors(target, demo("fsdp2-w1").reference_dir)
    assert_same_tensors(watched_model, demo("fsdp2-w1").reference_dir)
    timing = r"run started ([\d.]+) s after the event; model published ([\d.]+) s"
    started_after, published_after = map(float, re.search(timing, first.stdout).groups())  # worker just started
    started_again, republished_after = map(float, re.search(timing, second.stdout).groups())  # cache hit
    print(f"event -> run start {started_after} s (worker polling: {started_again} s), "
          f"event -> published model {published_after} s (cache hit: {republished_after} s)")
    assert started_again < 60  # the goal is 5 s on an idle machine; 2 shared, loaded cores are far slower
    assert_only_outer_runs_send_heartbeats(service["api"])


def assert_only_outer_runs_send_heartbeats(api: str) -> None:
    """A deployment's run keeps Prefect's flow-run heartbeat; its nested flows (same process) start none, since
    Prefect joins each heartbeat thread at the end of its run, up to 1 s apiece (was ~2 s of every event)."""
    import httpx

    runs = httpx.post(f"{api}/flow_runs/filter", json={"limit": 200}).json()
    answer = httpx.post(f"{api}/events/filter", json={"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]}},
                                                      "limit": 50})  # the server's most per page
    assert answer.status_code == 200, answer.text
    assert answer.json()["total"] <= 50, "more heartbeats than one page: read the next pages too"
    events = answer.json()["events"]
    beating = {event["resource"]["prefect.resource.id"].removeprefix("prefect.flow-run.") for event in events}
    nested = [run for run in runs if run["parent_task_run_id"]]
    assert nested and any(not run["parent_task_run_id"] and run["id"] in beating for run in runs)
    assert not [run["name"] for run in nested if run["id"] in beating]


def watch_a_slow_copy_then_wait_for_its_promotion(service, original: Path) -> Path:
    """`ckptflow watch --once` (as cron runs it) over a folder a checkpoint is copied into in parts: nothing is
    announced until the copy is complete and unchanged across two polls, then once; the worker promotes it."""
    import shutil

    incoming = service["home"] / "incoming"
    copy = incoming / "watched-run"
    state = ["--state", service["home"] / "watch-state.json"]
    files = sorted(rel for p in original.rglob("*") if p.is_file() and (rel := p.relative_to(original)).parts[0] != "reference")
    later = [rel for rel in files if "model_world_size" in rel.name]  # the model rank file arrives last
    polls = []
    for part in ([rel for rel in files if rel not in later], later):
        for rel in part:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(original / rel, copy / rel)
        polls.append(ckptflow(service, "watch", incoming, "--once", *state))
    polls += [ckptflow(service, "watch", incoming, "--once", *state) for _ in range(2)]
    assert all(p.returncode == 0 for p in polls), [p.stderr for p in polls]
    announced = [p.stdout.count("announced ") for p in polls]
    assert announced == [0, 0, 1, 0], [p.stdout for p in polls]  # incomplete, then not yet stable, then once
    model = service["root"] / "watched-run" / "step-1"
    deadline = time.monotonic() + 150
    while not (model / "ckptflow_manifest.json").exists():
        assert time.monotonic() < deadline, (service["home"] / "worker.log").read_text()[-3000:]
        time.sleep(0.5)
    return model


def assert_same_tensors(folder: Path, reference: Path) -> None:
    """The published weights equal what `save_pretrained` wrote for the trained model."""
    from safetensors.torch import load_file

    load = lambda where: {k: v for f in sorted(where.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    ours, theirs = load(folder), load(reference)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].equal(tensor.to(ours[name].dtype)), name  # dtype auto: config.json's torch_dtype
