"""Pushing merged folders with the real huggingface_hub client to a loopback Hub."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mergecore import CheckpointError, merge_checkpoint
from mergecore.hub import push_folder


@pytest.fixture(scope="module")
def merged(demo, tmp_path_factory):
    target = tmp_path_factory.mktemp("merged") / "model"
    manifest = merge_checkpoint(str(demo("fsdp2-w2").role_dir), target)
    return target, manifest


def test_push_creates_branch_and_tag_and_is_idempotent(hub, merged):
    folder, _ = merged
    first = push_folder(folder, "alice/model", revision="step-1", tag="v1")
    assert first["new_commit"] and first["revision"] == "step-1"
    files = hub.files("alice/model", revision="step-1")
    for path in folder.iterdir():
        assert files[path.name] == path.read_bytes()
    assert hub.files("alice/model", revision="v1") == files
    assert hub.repo("alice/model").private is True

    commits = len(hub.commits("alice/model", branch="step-1"))
    seen = len(hub.requests)
    again = push_folder(folder, "alice/model", revision="step-1", tag="v1")
    assert not again["new_commit"] and again["commit"] == first["commit"]
    assert len(hub.commits("alice/model", branch="step-1")) == commits
    assert not any(r.method == "PUT" for r in hub.requests[seen:])  # nothing re-uploaded


def test_stale_files_of_an_earlier_push_are_removed(hub, merged, tmp_path):
    folder, _ = merged
    import shutil

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "stale.txt").write_text("old")
    push_folder(other, "alice/model")
    push_folder(folder, "alice/model")
    assert "stale.txt" not in hub.files("alice/model")


def test_transient_errors_are_retried(hub, merged):
    folder, _ = merged
    hub.fail_next("POST", r"/preupload/", 429)
    hub.fail_next("PUT", r"/_lfs/upload/", 503)
    pushed = push_folder(folder, "alice/retried")
    assert pushed["new_commit"]
    statuses = [r.status for r in hub.requests]
    assert 429 in statuses and 503 in statuses


def test_bad_token_is_a_clear_error(hub, merged, monkeypatch):
    folder, _ = merged
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(CheckpointError, match=r"HTTP 401 .*HF_TOKEN"):
        push_folder(folder, "alice/model")


def test_someone_elses_namespace_is_refused(hub, merged):
    folder, _ = merged
    push_folder(folder, "alice/private-model")
    with pytest.raises(CheckpointError, match="alice/private-model"):
        push_folder(folder, "alice/private-model", token="hf_bob")


def test_merge_cli_upload_flags(hub, cli, demo, tmp_path):
    result = cli("merge", "--backend", "fsdp", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out",
                 "--hf_upload_path", "alice/from-cli", "--private", "--revision", "step-1")
    assert result.exit_code == 0, result.output
    assert "pushed to" in result.stdout
    card = hub.files("alice/from-cli", revision="step-1")["README.md"].decode()
    assert card.startswith("---\nlibrary_name: transformers\n") and "| round-trip | passed |" in card
    assert "| world size | 2 |" in card


# ---- faults: throttling, server errors, dropped connections, and the token

def folder_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def quick_hub_retries(monkeypatch):
    monkeypatch.setenv("CKPTFLOW_HUB_BACKOFF", "0.01")


@pytest.fixture(scope="module")
def merged_in_shards(demo, tmp_path_factory):
    """The same checkpoint as `merged`, in bf16 and several shards: other LFS objects to upload."""
    target = tmp_path_factory.mktemp("sharded") / "model"
    merge_checkpoint(str(demo("fsdp2-w2").role_dir), target, dtype="bf16", max_shard_size="100KB")
    assert len(list(target.glob("*.safetensors"))) > 1
    return target


def test_throttled_and_failing_calls_are_retried_until_the_push_completes(hub, merged, quick_hub_retries):
    folder, _ = merged
    retry_now = {"Retry-After": "0"}
    # Retried by huggingface_hub itself (about 1 s each):
    hub.fail_next("POST", r"/preupload/", 429, headers=retry_now)
    hub.fail_next("POST", r"\.git/info/lfs/objects/batch$", 503)
    hub.fail_next("PUT", r"^/_lfs/upload/", 503)
    hub.fail_next("GET", r"/tree/", 429, headers=retry_now)
    # Sent once by the client, retried by push_folder:
    hub.fail_next("POST", r"^/api/repos/create$", 429, headers=retry_now)
    hub.fail_next("GET", r"^/api/models/alice/faulty/revision/", 502)
    hub.fail_next("POST", r"/branch/step-1$", 503)
    hub.fail_next("POST", r"/commit/step-1$", 503, times=2, headers=retry_now)
    hub.fail_next("POST", r"/tag/[0-9a-f]{40}$", 500)  # the tag is made on the pushed commit itself

    pushed = push_folder(folder, "alice/faulty", revision="step-1", tag="v1")

    assert [f.remaining for f in hub._failures] == [0] * 9  # every fault was met
    assert sorted(r.status for r in hub.requests if r.status >= 400 and r.status != 404) == [429, 429, 429, 500, 502, 503, 503, 503,
                                                                       503, 503]
    assert pushed["new_commit"]
    files = hub.files("alice/faulty", revision="v1")
    assert {k: v for k, v in files.items() if k != ".gitattributes"} == folder_files(folder)
    assert len(hub.commits("alice/faulty", branch="step-1")) == 2  # the initial commit + exactly one push


def test_persistent_503_is_one_line_and_exit_2(hub, cli, demo, tmp_path, monkeypatch, quick_hub_retries):
    monkeypatch.setenv("CKPTFLOW_HUB_RETRIES", "2")
    hub.fail_next("POST", r"/commit/main$", 503, times=1000, headers={"Retry-After": "0"})
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out",
                 "--hf_upload_path", "alice/unavailable")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # beside progress bars
    assert len(errors) == 1 and "alice/unavailable: HTTP 503" in errors[0] and errors[0].endswith("(the branch is unchanged)")
    assert sum("/commit/" in r.path for r in hub.requests) == 3  # one try + CKPTFLOW_HUB_RETRIES
    assert [c.title for c in hub.commits("alice/unavailable")] == ["initial commit"]


@pytest.mark.parametrize("fault", ["503", "dropped"])
def test_interrupted_push_changes_nothing_and_the_next_push_completes(hub, merged, merged_in_shards, fault,
                                                                      quick_hub_retries):
    from huggingface_hub import HfApi

    folder, _ = merged
    first = push_folder(folder, "alice/model", revision="step-1")
    old_files = hub.files("alice/model", revision="step-1")

    # The new shards reach the server, then every commit request fails or loses its connection.
    if fault == "503":
        hub.fail_next("POST", r"/commit/step-1$", 503, times=1000, headers={"Retry-After": "0"})
    else:
        hub.drop_next("POST", r"/commit/step-1$", times=1000)
    with pytest.raises(CheckpointError, match="HTTP 503" if fault == "503" else "connection failed") as failed:
        push_folder(merged_in_shards, "alice/model", revision="step-1")
    assert "\n" not in str(failed.value)
    new_shards = {hashlib.sha256(p.read_bytes()).hexdigest() for p in merged_in_shards.glob("*.safetensors")}
    assert new_shards <= set(hub.repo("alice/model").lfs_objects)  # uploads happened before the interruption
    assert hub.repo("alice/model").branches["step-1"] == first["commit"]
    assert hub.files("alice/model", revision="step-1") == old_files

    hub._failures.clear()  # the service is back
    seen = len(hub.requests)
    second = push_folder(merged_in_shards, "alice/model", revision="step-1")
    assert second["new_commit"] and second["commit"] != first["commit"]
    assert not any(r.method == "PUT" for r in hub.requests[seen:])  # the shards were not sent again
    files = hub.files("alice/model", revision="step-1")
    assert {k: v for k, v in files.items() if k != ".gitattributes"} == folder_files(merged_in_shards)
    check = HfApi().verify_repo_checksums("alice/model", revision="step-1", local_dir=merged_in_shards)
    assert check.mismatches == [] and check.extra_paths == []


SECRET = "hf_SECRETtoken123"


def test_the_token_never_leaks(hub, cli, demo, tmp_path, monkeypatch, caplog, quick_hub_retries):
    import logging

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("CKPTFLOW_HUB_RETRIES", "1")
    hub.tokens.update({SECRET: "alice", "hf_SECRETbob456": "bob"})
    source = demo("fsdp2-w2").role_dir
    outputs = []

    def merge_and_push(run: str, token: str, repo: str) -> int:
        monkeypatch.setenv("HF_TOKEN", token)
        result = cli("merge", "--local_dir", source, "--target_dir", tmp_path / run, "--hf_upload_path", repo)
        outputs.append(result.stdout + result.stderr)
        return result.exit_code

    assert merge_and_push("ok", SECRET, "alice/leak-check") == 0
    assert merge_and_push("unknown-token", "hf_SECRETwrong789", "alice/leak-check2") == 2  # 401
    assert merge_and_push("forbidden", "hf_SECRETbob456", "alice/leak-check") == 2  # 403: alice's repo
    hub.fail_next("POST", r"/commit/", 503, times=1000, headers={"Retry-After": "0"})
    assert merge_and_push("unavailable", SECRET, "alice/leak-check3") == 2
    assert [s for s in ("401", "403", "503") if any(f"HTTP {s}" in o for o in outputs)] == ["401", "403", "503"]

    written = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())  # targets, HF_HOME, caches
    pushed = b"".join(hub.files("alice/leak-check").values())
    for secret in (SECRET, "hf_SECRETwrong789", "hf_SECRETbob456"):
        assert secret not in "".join(outputs) + caplog.text
        assert secret.encode() not in written + pushed
    assert "README.md" in hub.files("alice/leak-check")


def test_the_token_never_leaks_from_a_promotion(prefect_server, hub, cli, demo, tmp_path, monkeypatch, caplog,
                                               quick_hub_retries):
    """`ckptflow promote` on a real Prefect server whose push fails (persistent 503): the token is nowhere in the
    output, the files, the artifacts, the logs, the run states or the server's database. (A successful
    promotion's artifacts are checked in test_pipeline; its push is the same `push_folder` call.)"""
    import json
    import logging

    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("CKPTFLOW_HUB_RETRIES", "1")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    hub.tokens[SECRET] = "alice"
    ckpt = demo("fsdp2-w2")
    hub.fail_next("POST", r"/commit/", 503, times=1000, headers={"Retry-After": "0"})
    failed = cli("promote", ckpt.run_root, "--target", tmp_path / "failed", "--hub-repo", "alice/promoted-later")
    assert failed.exit_code == 2 and "HTTP 503" in failed.stderr

    with get_client(sync_client=True) as client:
        recorded = [a.data for a in client.read_artifacts()]
        recorded += [log.message for log in client.read_logs()]
        runs = client.read_flow_runs() + client.read_task_runs()
        recorded += [(r.name, r.parameters if hasattr(r, "parameters") else None, r.state and r.state.message)
                     for r in runs]
    assert any("HTTP 503" in str(item) for item in recorded)  # the failure did reach the server
    texts = failed.output + caplog.text + json.dumps(recorded, default=str)
    assert SECRET not in texts
    written = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())  # targets, results, HF_HOME
    assert SECRET.encode() not in written
    database = get_current_settings().server.database.connection_url.get_secret_value()
    files = list(Path(database.split("///", 1)[-1]).parent.glob("*.db*")) if "sqlite" in database else []
    assert files and SECRET.encode() not in b"".join(f.read_bytes() for f in files)


# ---- one commit per push, with huggingface_hub's Xet detection on (as on a user's machine)

def test_a_push_is_one_commit_with_xet_available(hub, monkeypatch, tmp_path):
    """With `hf_xet` installed, `upload_folder` commits in batches of 250 files and deletes old files in the first
    batch. A push must be one commit however large the folder: 300 tiny files (regular files, which need no Xet
    storage) over an earlier push whose stale file must go in that same commit."""
    import json

    from huggingface_hub.utils._runtime import is_xet_available

    from hub_server import DEFAULT_GITATTRIBUTES

    hub.configure_client(monkeypatch, tmp_path / "hf-home-xet", xet=True)
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    assert is_xet_available()
    earlier, folder = tmp_path / "earlier", tmp_path / "many"
    earlier.mkdir()
    folder.mkdir()
    (earlier / "stale.txt").write_text("from an earlier push")
    for i in range(300):
        (folder / f"part-{i:03d}.json").write_text(json.dumps({"part": i}))
    (earlier / "part-000.json").write_text("an older part 0")
    first = push_folder(earlier, "alice/many")

    seen = len(hub.requests)
    pushed = push_folder(folder, "alice/many")
    commits = hub.commits("alice/many")
    assert [c.oid for c in commits[:2]] == [pushed["commit"], first["commit"]]  # exactly one new commit
    assert sum(r.method == "POST" and "/commit/" in r.path for r in hub.requests[seen:]) == 1
    expected = {p.name: p.read_bytes() for p in folder.iterdir()} | {".gitattributes": DEFAULT_GITATTRIBUTES.encode()}
    assert hub.files("alice/many") == expected  # every add and the deletion of stale.txt, in that one commit

    again = push_folder(folder, "alice/many")  # unchanged: no commit
    assert not again["new_commit"] and hub.commits("alice/many")[0].oid == pushed["commit"]


# ---- tags

def test_a_tag_on_another_commit_is_refused_and_a_rerun_keeps_it(hub, merged, merged_in_shards):
    folder, _ = merged
    first = push_folder(folder, "alice/tagged", revision="step-1", tag="v1")
    assert push_folder(folder, "alice/tagged", revision="step-1", tag="v1")["tag"] == "v1"  # a rerun: same commit

    for branch in ("step-1", "step-2"):  # a new commit on the tagged branch, or on another branch
        seen = len(hub.requests)
        with pytest.raises(CheckpointError) as refused:
            push_folder(merged_in_shards, "alice/tagged", revision=branch, tag="v1")
        message = str(refused.value)
        assert "\n" not in message and "tag v1" in message and first["commit"] in message
        assert "choose another --tag" in message and "delete the tag" in message
        assert not any(r.method == "POST" and "/commit/" in r.path for r in hub.requests[seen:])  # nothing pushed
    repo = hub.repo("alice/tagged")
    assert repo.tags == {"v1": first["commit"]} and repo.branches["step-1"] == first["commit"]
    assert "step-2" not in repo.branches


# ---- folders the Hub cannot hold as they are: refused before any Hub call

@pytest.fixture
def folder_copy(merged, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(merged[0], copy)
    return copy


def test_a_file_name_that_is_not_utf8_is_refused_before_any_hub_call(hub, folder_copy):
    (folder_copy / "extra").mkdir()
    with open(os.path.join(os.fsencode(folder_copy / "extra"), b"\xff.txt"), "wb") as f:
        f.write(b"from huggingface/")
    with pytest.raises(CheckpointError) as refused:
        push_folder(folder_copy, "alice/bad-name")
    message = str(refused.value)
    assert "\n" not in message and "extra/\\xff.txt" in message and "not valid UTF-8" in message
    assert hub.requests == []  # no repo created


@pytest.mark.parametrize("kind", ["link", "pipe"])
def test_a_link_or_special_file_is_refused_before_any_hub_call(hub, folder_copy, kind):
    if kind == "link":
        (folder_copy / "alias.json").symlink_to(folder_copy / "config.json")
    else:
        os.mkfifo(folder_copy / "alias.json")
    with pytest.raises(CheckpointError, match=r"alias\.json: (a symbolic link|not a regular file)") as refused:
        push_folder(folder_copy, "alice/linked")
    assert "\n" not in str(refused.value)
    assert hub.requests == []


# ---- an endpoint that is not the Hub

@pytest.fixture
def captive_portal():
    """A web server answering every request with 200 and an HTML page, as a captive portal or a mistyped
    HF_ENDPOINT does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Portal(BaseHTTPRequestHandler):
        def do_GET(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            page = b"<!doctype html><html><body>Please sign in to the network</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        do_POST = do_PUT = do_HEAD = do_DELETE = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Portal)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_endpoint_answering_html_is_one_line_and_exit_2(captive_portal, demo, tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=captive_portal, HF_TOKEN="hf_alice", HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_DISABLE_TELEMETRY="1")
    run = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "merge", "--local_dir", str(demo("fsdp2-w2").role_dir),
                          "--target_dir", str(tmp_path / "out"), "--hf_upload_path", "alice/portal"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr
    assert f"HF_ENDPOINT {captive_portal} answered with something that is not the Hub API" in errors[0]
    assert "check HF_ENDPOINT" in errors[0]
