"""Drive tests/hub_server.py with the real huggingface_hub client only (HfApi / hf_hub_download).

huggingface_hub reads its environment at import time, so instead of relying on env vars set before the
import (which fails if anything imported it earlier in the session) the `hub` fixture calls
`HubServer.configure_client`, which sets the env vars *and* patches `huggingface_hub.constants`
(HF_HUB_DISABLE_XET, HF_HUB_DISABLE_TELEMETRY, HF_HOME and the cache/token paths, ENDPOINT) for one test.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

try:
    from hub_server import HubServer
except ImportError:  # tests/ turned into a package
    from tests.hub_server import HubServer

ALICE, BOB = "hf_alice_token", "hf_bob_token"
REPO = "alice/ckpt"
BIG_SIZE = 11 * 1024 * 1024  # above the Hub's 10 MiB LFS threshold


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer(tokens={ALICE: "alice", BOB: "bob"}) as server:
        server.configure_client(monkeypatch, tmp_path / "hf_home")
        yield server
        assert server.server_errors == []


@pytest.fixture
def alice(hub):
    return HfApi(endpoint=hub.url, token=ALICE)


@pytest.fixture
def bob(hub):
    return HfApi(endpoint=hub.url, token=BOB)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "model"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(random.Random(0).randbytes(BIG_SIZE))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 16}))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return folder


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def statuses(hub: HubServer, method: str, fragment: str) -> list[int]:
    return [r.status for r in hub.requests if r.method == method and fragment in r.path]


def test_upload_roundtrip_is_byte_identical_and_idempotent(hub, alice, model_dir, tmp_path):
    alice.create_repo(REPO, private=True)
    alice.create_repo(REPO, private=True, exist_ok=True)  # 409 swallowed by the client
    assert len(hub.commits(REPO)) == 1  # the Hub's "initial commit" with .gitattributes

    first = alice.upload_folder(repo_id=REPO, folder_path=model_dir, commit_message="step 0")
    assert statuses(hub, "PUT", "/_lfs/upload/") == [200]  # only the big file went through LFS
    assert hub.files(REPO) == {**local_files(model_dir), ".gitattributes": hub.files(REPO)[".gitattributes"]}
    assert alice.model_info(REPO).sha == first.oid == hub.commits(REPO)[0].oid

    for path, content in local_files(model_dir).items():
        downloaded = hf_hub_download(REPO, path, revision=first.oid, token=ALICE, endpoint=hub.url,
                                     cache_dir=tmp_path / "cache")
        assert Path(downloaded).read_bytes() == content

    # Same folder again: preupload reports the remote oids, the client drops every file and makes no commit.
    n_requests = len(hub.requests)
    second = alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    again = [(r.method, r.path) for r in hub.requests[n_requests:]]
    assert second.oid == first.oid
    assert len(hub.commits(REPO)) == 2
    assert len(alice.list_repo_commits(REPO)) == 2
    assert not [r for r in again if r[0] == "PUT" or "/commit/" in r[1]]
    assert ("POST", f"/api/models/{REPO}/preupload/main") in again
    assert ("GET", f"/api/models/{REPO}/revision/main") in again  # how the client learns the head sha

    # One changed small file: one new commit, and the unchanged LFS object is not uploaded again.
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    third = alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert third.oid != first.oid and len(hub.commits(REPO)) == 3
    assert statuses(hub, "PUT", "/_lfs/upload/") == [200]


def test_tree_lists_lfs_and_regular_files_recursively(hub, alice, model_dir):
    alice.create_repo(REPO)
    alice.upload_folder(repo_id=REPO, folder_path=model_dir)

    entries = {e.path: e for e in alice.list_repo_tree(REPO, recursive=True)}
    assert set(entries) == {".gitattributes", "config.json", "generation_config.json", "model.safetensors",
                            "tokenizer", "tokenizer/tokenizer_config.json"}
    big = entries["model.safetensors"]
    assert big.lfs is not None and big.lfs.sha256 == hub.repo(REPO).commits[hub.commits(REPO)[0].oid].tree[
        "model.safetensors"].sha256
    assert big.size == BIG_SIZE
    assert entries["config.json"].lfs is None
    assert type(entries["tokenizer"]).__name__ == "RepoFolder"

    top_level = {e.path for e in alice.list_repo_tree(REPO)}
    assert "tokenizer/tokenizer_config.json" not in top_level and "tokenizer" in top_level
    assert sorted(alice.list_repo_files(REPO)) == sorted(p for p, e in entries.items() if hasattr(e, "blob_id"))


def test_branch_tag_and_refs(hub, alice, model_dir, tmp_path):
    alice.create_repo(REPO)
    main_commit = alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    alice.create_branch(REPO, branch="step-1")
    alice.create_branch(REPO, branch="step-1", exist_ok=True)

    (model_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 32}))
    step1 = alice.upload_folder(repo_id=REPO, folder_path=model_dir, revision="step-1")
    assert len(hub.commits(REPO, "main")) == 2
    assert len(hub.commits(REPO, "step-1")) == 3
    assert len(alice.list_repo_commits(REPO, revision="step-1")) == 3

    alice.create_tag(REPO, tag="v1", revision="step-1")
    refs = alice.list_repo_refs(REPO)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": main_commit.oid, "step-1": step1.oid}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": step1.oid}
    assert alice.model_info(REPO, revision="v1").sha == step1.oid
    assert alice.repo_info(REPO, revision="step-1").sha == step1.oid

    path = hf_hub_download(REPO, "generation_config.json", revision="step-1", token=ALICE, endpoint=hub.url)
    assert json.loads(Path(path).read_text()) == {"max_new_tokens": 32}
    assert path.startswith(str(tmp_path / "hf_home"))  # the patched HF_HOME cache was used
    assert json.loads(hub.files(REPO, "main")["generation_config.json"]) == {"max_new_tokens": 16}


def test_verify_repo_checksums(hub, alice, model_dir):
    alice.create_repo(REPO)
    alice.upload_folder(repo_id=REPO, folder_path=model_dir)

    ok = alice.verify_repo_checksums(REPO, local_dir=model_dir)
    assert ok.mismatches == [] and ok.extra_paths == []
    assert ok.missing_paths == [".gitattributes"]  # created by the Hub, not in the local folder
    assert ok.checked_count == len(local_files(model_dir)) == 4

    (model_dir / "config.json").write_text("{}")
    with (model_dir / "model.safetensors").open("r+b") as f:
        f.seek(BIG_SIZE // 2)
        f.write(b"\xff\xfe")
    bad = alice.verify_repo_checksums(REPO, local_dir=model_dir)
    assert {(m["path"], m["algorithm"]) for m in bad.mismatches} == {
        ("config.json", "git-sha1"), ("model.safetensors", "sha256")}


def test_auth_and_not_found_errors(hub, alice, bob, model_dir):
    with pytest.raises(HfHubHTTPError) as bad_token:
        HfApi(endpoint=hub.url, token="hf_wrong").create_repo("alice/x")
    assert bad_token.value.response.status_code == 401
    assert not isinstance(bad_token.value, RepositoryNotFoundError)
    with pytest.raises(HfHubHTTPError) as whoami:
        HfApi(endpoint=hub.url, token="hf_wrong").whoami()
    assert whoami.value.response.status_code == 401
    assert alice.whoami()["name"] == "alice"

    with pytest.raises(RepositoryNotFoundError):
        alice.repo_info("alice/missing")
    with pytest.raises(RepositoryNotFoundError):
        alice.upload_folder(repo_id="alice/missing", folder_path=model_dir)

    alice.create_repo(REPO)  # public
    alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    with pytest.raises(HfHubHTTPError) as forbidden:
        bob.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert forbidden.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as forbidden_create:
        bob.create_repo("alice/other")
    assert forbidden_create.value.response.status_code == 403

    with pytest.raises(RevisionNotFoundError):
        alice.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        alice.upload_folder(repo_id=REPO, folder_path=model_dir, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="no-such-branch", token=ALICE, endpoint=hub.url)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.json", token=ALICE, endpoint=hub.url)


def test_private_repo_is_invisible_to_others(hub, alice, bob, model_dir):
    alice.create_repo("alice/secret", private=True)
    alice.create_repo("alice/open", private=False)
    assert alice.model_info("alice/secret").private is True

    anonymous = HfApi(endpoint=hub.url, token=False)
    for api in (bob, anonymous):
        with pytest.raises(RepositoryNotFoundError):
            api.model_info("alice/secret")
        with pytest.raises(RepositoryNotFoundError):
            api.list_repo_files("alice/secret")
        assert api.model_info("alice/open").private is False
    with pytest.raises(RepositoryNotFoundError):  # 404, not 403: existence is not leaked
        bob.upload_folder(repo_id="alice/secret", folder_path=model_dir)


def test_transient_errors_are_retried(hub, alice, model_dir):
    alice.create_repo(REPO)
    hub.fail_next("POST", r"/preupload/", 429, headers={"Retry-After": "0"})
    hub.fail_next("PUT", r"^/_lfs/upload/", 503)

    alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert statuses(hub, "POST", "/preupload/") == [429, 200]
    assert statuses(hub, "PUT", "/_lfs/upload/") == [503, 200]
    assert hub.files(REPO)["model.safetensors"] == (model_dir / "model.safetensors").read_bytes()


def test_commit_post_is_not_retried(hub, alice, model_dir):
    alice.create_repo(REPO)
    hub.fail_next("POST", r"/commit/main$", 503)
    with pytest.raises(HfHubHTTPError) as err:
        alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert err.value.response.status_code == 503
    assert len(hub.commits(REPO)) == 1
    # The LFS object did reach the server, so a rerun skips its upload and commits at once.
    alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert statuses(hub, "PUT", "/_lfs/upload/") == [200]
    assert len(hub.commits(REPO)) == 2


def test_listings_follow_pagination_on_dataset_repos(tmp_path, monkeypatch, model_dir):
    with HubServer(tokens={ALICE: "alice"}, page_size=2) as small_pages:
        small_pages.configure_client(monkeypatch, tmp_path / "hf_home")
        api = HfApi(token=ALICE)  # no endpoint: configure_client pointed constants.ENDPOINT here
        api.create_repo("alice/data", repo_type="dataset")
        for step in range(3):
            (model_dir / "config.json").write_text(json.dumps({"step": step}))
            api.upload_folder(repo_id="alice/data", repo_type="dataset", folder_path=model_dir)

        assert len(api.list_repo_commits("alice/data", repo_type="dataset")) == 4
        assert len(small_pages.commits("alice/data", repo_type="dataset")) == 4
        files = api.list_repo_files("alice/data", repo_type="dataset")
        assert sorted(files) == sorted([".gitattributes", *local_files(model_dir)])
        assert sum("/tree/" in r.path for r in small_pages.requests) > 1  # followed the Link header
        path = hf_hub_download("alice/data", "config.json", repo_type="dataset", token=ALICE)
        assert json.loads(Path(path).read_text()) == {"step": 2}
        assert small_pages.server_errors == []


def test_dropped_connections(hub, alice, model_dir):
    import httpx2

    alice.create_repo(REPO)
    hub.drop_next("POST", r"/preupload/")  # the client retries a dropped preupload...
    hub.drop_next("POST", r"/commit/main$")  # ...but sends the commit only once
    with pytest.raises(httpx2.RemoteProtocolError):
        alice.upload_folder(repo_id=REPO, folder_path=model_dir)
    assert statuses(hub, "POST", "/preupload/") == [0, 200]
    assert statuses(hub, "POST", "/commit/") == [0]
    assert len(hub.commits(REPO)) == 1  # nothing was committed
    alice.upload_folder(repo_id=REPO, folder_path=model_dir)  # the connection pool recovers
    assert len(hub.commits(REPO)) == 2 and hub.server_errors == []
