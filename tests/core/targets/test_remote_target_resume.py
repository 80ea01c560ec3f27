"""An interrupted merge to object storage resumes, and someone else's files at a prefix stay refused.

Real components only: moto's S3 server on loopback (s3fs talks to it), `ckptflow merge` as a real process killed
with SIGKILL (its whole process group) once its first weight object appears on the server, and the real target
API for a run's leftovers. What is arranged is on the server's side, never in ckptflow: time — the store holds
back the PUTs of the per-file staging records (keys under `.ckptflow-staging/`) until the kill, as a slow store
may, so the kill lands in the window that matters (a weight object stored, its record not yet) every time,
not by luck — and, for the crash after the publish, a store refusing one DELETE.
"""

from __future__ import annotations

from helpers import REPO, Looking, objects
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

s3fs = pytest.importorskip("s3fs")

MANIFEST = "ckptflow_manifest.json"
RECORDS = ".ckptflow-staging/"
MARKER = ".ckptflow-staging.json"  # a run's marker: what it is about to write, put there before its first object
SHARDS = ("--max-shard-size", "64KB", "--dtype", "bf16")  # several weight files: a kill lands between two of them


@pytest.fixture
def bucket(s3_env):
    import uuid

    name = f"resume-{uuid.uuid4().hex[:8]}"
    s3_env.mkdir(name)
    return name


@pytest.fixture
def held_records(monkeypatch):
    """`held_records(prefix)`: from then on the store holds back every staging-record PUT under `prefix` (a key
    under `prefix/.ckptflow-staging/`) until `held_records(None)`, and then drops it (its writer is dead by then):
    what a run killed between a weight object and its record leaves."""
    from moto.s3.models import S3Backend

    put = S3Backend.put_object
    held: dict = {"prefix": None, "arrived": 0}
    released = threading.Event()

    def put_object(self, bucket_name, key_name, *args, **kwargs):
        if held["prefix"] and f"{bucket_name}/{key_name}".startswith(f"{held['prefix']}/{RECORDS}"):
            held["arrived"] += 1
            released.wait(120)
            raise ConnectionAbortedError("the client went away")  # never stored
        return put(self, bucket_name, key_name, *args, **kwargs)

    def hold(prefix: str | None) -> None:
        if prefix is None:
            # a PUT the killed writer sent may still be on its way through the server (a loaded machine): wait
            # until no held one has arrived for a while, so none slips through once the hold is lifted
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                arrived = held["arrived"]
                time.sleep(0.5)
                if held["arrived"] == arrived:
                    break
            released.set()
        held["prefix"] = prefix

    monkeypatch.setattr(S3Backend, "put_object", put_object)
    yield hold
    released.set()


def merge_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "ckptflow.flows.cli", "merge", *map(str, args)], cwd=REPO, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def kill_after_first_weight_object(fs, prefix: str, weights: set[str], process: subprocess.Popen) -> None:
    """SIGKILL `process`'s group as soon as one of the weight files `weights` is listed under `prefix`."""
    deadline = time.monotonic() + 180
    while process.poll() is None and time.monotonic() < deadline:
        fs.invalidate_cache()
        if {key[len(prefix) + 1:] for key in fs.find(prefix)} & weights:
            break
        time.sleep(0.01)
    assert process.poll() is None, f"finished before the kill: {process.communicate()[1][-3000:]}"
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


class PrefixWatch(Looking):
    """A thread listing a prefix every few milliseconds (its own s3fs client), as a reader polling for the model
    would: whenever it lists the manifest, every file that manifest names must be listed with its size."""

    every_s = 0.005

    def __init__(self, endpoint: str, prefix: str):
        super().__init__()
        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)
        self.prefix, self.violations, self.looks = prefix, [], 0

    def look(self):
        listed = {path[len(self.prefix) + 1:]: info["size"]
                  for path, info in self.fs.find(self.prefix, detail=True).items()}
        self.looks += 1
        try:
            manifest = json.loads(self.fs.cat_file(f"{self.prefix}/{MANIFEST}")) if MANIFEST in listed else None
        except FileNotFoundError:  # deleted since the listing (an overwrite staging)
            manifest = None
        if manifest is not None:
            wrong = sorted(name for name, entry in manifest["files"].items() if listed.get(name) != entry["size"])
            if wrong:
                self.violations.append(f"manifest listed while {wrong} were not in place")


def merged_uninterrupted(cli, fs, role_dir, bucket: str) -> dict[str, bytes]:
    result = cli("merge", "--local_dir", role_dir, "--target_dir", f"s3://{bucket}/baseline", *SHARDS)
    assert result.exit_code == 0, result.output
    return objects(fs, f"{bucket}/baseline")


def assert_same_model(mine: dict[str, bytes], theirs: dict[str, bytes]) -> None:
    """Every object byte for byte but the manifest (timings, the date); the manifest's files, sizes and sha256s."""
    assert sorted(mine) == sorted(theirs)
    for name in set(theirs) - {MANIFEST}:
        assert mine[name] == theirs[name], name
    listed = lambda stored: {name: (entry["sha256"], entry["size"])  # noqa: E731
                             for name, entry in json.loads(stored[MANIFEST])["files"].items()}
    assert listed(mine) == listed(theirs)


@pytest.mark.parametrize("over", ["an empty prefix", "a published model, with --overwrite"])
def test_a_merge_killed_after_its_first_weight_object_resumes(s3_env, s3_endpoint, bucket, held_records, demo, cli,
                                                              over):
    """Was refused on the rerun, --overwrite or not ("holds files that are not a model ckptflow published"), and the
    prefix stayed blocked until emptied by hand."""
    role_dir = demo("fsdp2-w2").role_dir
    baseline = merged_uninterrupted(cli, s3_env, role_dir, bucket)
    prefix, overwrite = f"{bucket}/killed", ("--overwrite",) if "overwrite" in over else ()
    if overwrite:  # an earlier model there, in other files (one fp32 file): the kill comes mid-overwrite
        earlier = cli("merge", "--local_dir", role_dir, "--target_dir", f"s3://{prefix}", "--dtype", "fp32")
        assert earlier.exit_code == 0, earlier.output
        assert "model-00001-of-00001.safetensors" in set(objects(s3_env, prefix)) - set(baseline)  # gone at the end
    weights = {name for name in json.loads(baseline[MANIFEST])["files"] if name.endswith(".safetensors")}

    held_records(prefix)
    with PrefixWatch(s3_endpoint, prefix) as watch:
        kill_after_first_weight_object(s3_env, prefix, weights, merge_process(
            "--local_dir", role_dir, "--target_dir", f"s3://{prefix}", *SHARDS, *overwrite))
        held_records(None)
        left = objects(s3_env, prefix)
        assert MANIFEST not in left and set(left) & weights  # no model, and a weight file of this merge
        assert not [name for name in left if name.startswith(RECORDS)]  # ... and no record of it: the window aimed at

        rerun = cli("merge", "--local_dir", role_dir, "--target_dir", f"s3://{prefix}", *SHARDS, *overwrite)
        assert rerun.exit_code == 0, rerun.output
    assert watch.violations == [] and watch.looks > 10

    published = objects(s3_env, prefix)
    assert_same_model(published, baseline)  # no leftover of the killed run nor of the earlier model, no marker
    checked = cli("verify", f"s3://{prefix}", "--source", role_dir)
    assert checked.exit_code == 0, checked.output
    assert "round-trip" in checked.stdout


def refused(result, url: str, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith(f"error: {url}") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


THEIRS = {"notes.txt": b"our evaluation notes\n", "model-00001-of-00002.safetensors": b"their weights, not ours"}


@pytest.mark.parametrize("beside, refusal", [
    ("nothing", "not a model ckptflow published"),
    ("staging records", "not a model ckptflow published"),
    ("a marker ckptflow did not write", "is not a staging marker ckptflow wrote"),
], ids=["nothing", "staging records", "a marker ckptflow did not write"])
def test_someone_elses_files_stay_refused_and_untouched(s3_env, bucket, demo, cli, beside, refusal):
    """A prefix holding someone else's files, with no marker of a ckptflow run, is refused with and without
    --overwrite, and nothing there changes. With records under `.ckptflow-staging/` beside them (names anyone can
    write; no run recorded that it was about to write there) it was replaced: their files were deleted. An object
    at the marker's name that ckptflow did not write proves nothing either."""
    prefix = f"{bucket}/theirs"
    stored = dict(THEIRS)
    if beside == "staging records":
        stored[f"{RECORDS}model-00001-of-00002.safetensors.json"] = b'{"weights_id": "x", "receipt": {}}'
    elif beside.startswith("a marker"):
        stored[MARKER] = b'{"claimed": ["notes.txt"]}'
    for name, data in stored.items():
        s3_env.pipe_file(f"{prefix}/{name}", data)

    for overwrite in ((), ("--overwrite",)):
        result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", f"s3://{prefix}", *SHARDS,
                     *overwrite)
        refused(result, f"s3://{prefix}", refusal)
        assert objects(s3_env, prefix) == stored, overwrite


def test_files_beside_a_runs_own_leftovers_are_refused_by_name_and_nothing_is_touched(s3_env, bucket, demo, cli):
    """A run's leftovers (its marker, a weight file written and recorded) with someone's file put beside them: the
    prefix is no longer ckptflow's alone, so it is refused, with and without --overwrite, naming the file that is
    not ckptflow's; theirs and ours stay as they are. Was replaced, deleting their file."""
    from mergecore import assembly_for, prepare

    role_dir, prefix = demo("fsdp2-w2").role_dir, f"{bucket}/mixed"
    url = f"s3://{prefix}"
    prepared = prepare(str(role_dir), max_shard_size="64KB", dtype="bf16")
    target = assembly_for(url)
    with target.lock():  # a run that staged and wrote its first file, then died
        staged = target.stage(prepared, overwrite=False, sources=[str(role_dir)])
        target.write_unit(prepared, staged.created[0], staged)
    ours = objects(s3_env, prefix)
    assert staged.created[0] in ours
    s3_env.pipe_file(f"{prefix}/their-notes.txt", b"put here by someone else\n")

    for overwrite in ((), ("--overwrite",)):
        result = cli("merge", "--local_dir", role_dir, "--target_dir", url, *SHARDS, *overwrite)
        refused(result, url, "their-notes.txt")
        assert objects(s3_env, prefix) == {**ours, "their-notes.txt": b"put here by someone else\n"}, overwrite


def test_a_crash_after_the_manifest_leaves_the_model_and_the_next_run_clears_the_marker(s3_env, bucket, demo, cli,
                                                                                       monkeypatch):
    """The store refuses to delete the run's marker, so the merge fails right after its manifest was written: the
    model is published (the manifest does not list the marker, and `verify` passes); the next run of this merge
    with --overwrite reuses it and removes the marker and records the crash left."""
    from moto.s3.exceptions import S3AccessDeniedError
    from moto.s3.models import S3Backend

    from mergecore import merge_checkpoint

    delete = S3Backend.delete_object

    def delete_object(self, bucket_name, key_name, *args, **kwargs):
        if key_name.endswith(f"/{MARKER}"):
            raise S3AccessDeniedError()
        return delete(self, bucket_name, key_name, *args, **kwargs)

    role_dir, prefix = demo("fsdp2-w2").role_dir, f"{bucket}/tidy"
    monkeypatch.setattr(S3Backend, "delete_object", delete_object)
    with pytest.raises(OSError):
        merge_checkpoint(str(role_dir), f"s3://{prefix}", max_shard_size="64KB", dtype="bf16")
    left = objects(s3_env, prefix)
    assert MANIFEST in left and MARKER in left
    assert MARKER not in json.loads(left[MANIFEST])["files"]
    checked = cli("verify", f"s3://{prefix}", "--source", role_dir)
    assert checked.exit_code == 0, checked.output

    monkeypatch.setattr(S3Backend, "delete_object", delete)
    rerun = cli("merge", "--local_dir", role_dir, "--target_dir", f"s3://{prefix}", *SHARDS, "--overwrite")
    assert rerun.exit_code == 0, rerun.output
    assert objects(s3_env, prefix) == {name: data for name, data in left.items() if name != MARKER}


def test_a_file_put_beside_a_running_merge_is_never_deleted_and_nothing_is_published(s3_env, bucket, demo):
    """Someone writes into the prefix while the merge runs (after its first weight file): the publish, which removes
    the objects an earlier model or run left, refuses instead of removing theirs, and no manifest appears."""
    from mergecore import CheckpointError, merge_checkpoint

    prefix = f"{bucket}/busy"
    intruder = f"{prefix}/their-notes.txt"

    def drop_a_file(unit, receipt):
        if not s3_env.exists(intruder):
            s3_env.pipe_file(intruder, b"put here by someone else\n")

    with pytest.raises(CheckpointError, match=r"their-notes\.txt appeared during the merge .*nothing was published"):
        merge_checkpoint(str(demo("fsdp2-w2").role_dir), f"s3://{prefix}", max_shard_size="64KB", dtype="bf16",
                         on_group=drop_a_file)
    left = objects(s3_env, prefix)
    assert MANIFEST not in left and left["their-notes.txt"] == b"put here by someone else\n"
