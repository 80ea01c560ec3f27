"""A folder on object storage (`s3://...`, any fsspec URL) as a target: written file by file, published by the manifest.

Object stores have no rename, so a folder cannot appear at once. The rule instead (docs/remote_targets.md):
**a folder is a model only while it holds `ckptflow_manifest.json`, and only the files the manifest lists,
with the sizes and sha256 it records, are that model.** And, so that a rerun can tell a killed run's leftovers
from anyone else's files: **every object a run writes at the target is named in its marker,
`.ckptflow-staging.json`, before it is written.** A merge into a remote target therefore

1. stages (`begin_run`): writes the run's marker first (the run, the merge, the planned weight files and what the
   target held that `check` let it replace), then deletes the target's old manifest, so from here on readers see
   no model, never a mix; weight files finished by an interrupted run of this very merge are kept (their records,
   under `.ckptflow-staging/`, match the merge and the stored objects: the very object proven, by size, ETag and
   time, so a partial or rewritten object is written again);
2. streams each remaining weight file to its final name, reads it back and proves it against the shards
   (`mergecore.assembly`, with `claim` before and `record` after each file; any machine can write any file, so
   a cluster writes them in parallel);
3. publishes (`publish_folder`): names the index, config, copied files and card in the marker, uploads them,
   removes objects an earlier model had, and writes the manifest last: that PUT publishes the model. The records
   and the marker go after it.

A crash before the manifest leaves no model, only objects the marker names: the next merge (`unfinished`) resumes
from the recorded files or, for another merge, replaces them, `--overwrite` or not. Objects the marker does not
name are someone else's and are never replaced. The lock is an
flock in a local state folder named after the URL: it keeps out writers on this machine only (object stores
offer no lock that ends with its holder).

>>> RemoteTarget(Location.of("s3://models/run1-step100")).unit  # doctest: +SKIP
'files'
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError, VerificationError
from ..model.manifest import MANIFEST_FILE, load_manifest
from ..storage import Location, default_cache_dir, fingerprint_of
from .base import Staged, Target
from .lock import target_lock

STAGING_RECORDS = ".ckptflow-staging"  # under a remote target: one record per finished file, gone once published
RUN_MARKER = ".ckptflow-staging.json"  # a run's marker at the target: written first, gone once published
MARKER_FORMAT = "ckptflow-remote-staging/1"


def _bookkeeping(name: str) -> bool:
    """Whether `name` (relative to the target) is one of a run's own staging objects: its marker, a file's record."""
    return name == RUN_MARKER or name.startswith(STAGING_RECORDS + "/")


def local_state_folder(target: str | Location) -> Path:
    """The local folder for a remote target's run state (the pipeline's cached results, its lock): fixed per URL."""
    location = Location.of(target)
    return default_cache_dir() / "targets" / f"{location.url_key()}-{location.name}"


class RemoteTarget(Target):
    unit = "files"

    def __init__(self, location: Location):
        self.location = location
        self.url = location.url
        state = local_state_folder(location)
        self.results_folder = state.parent / f".{state.name}.ckptflow-results"  # the pipeline's, on this machine

    @property
    def _fs_root(self):
        return self.location.fs_path

    @contextmanager
    def lock(self, timeout: float | None = None):
        locks = default_cache_dir() / "locks"  # beside the state folder, so a merge assembles nothing under it
        locks.mkdir(parents=True, exist_ok=True)
        with target_lock(locks / f"{local_state_folder(self.location).name}.lock", self.url, timeout):
            yield self

    def entries(self) -> list[str] | None:
        """Paths (relative to the target) of every object below it; None when there is none."""
        fs, root = self._fs_root
        fs.invalidate_cache(root)
        if not fs.isdir(root):
            return None
        return sorted(posixpath.relpath(path, root) for path in fs.find(root))

    def unfinished(self, entries: list[str]) -> bool:
        """Whether `entries` are an unfinished merge of ckptflow's and nothing else: no manifest, a run's marker,
        and only objects it names (and the records). A file beside it that the marker does not name is someone
        else's (publishing would delete it): refused by name, `--overwrite` or not."""
        if MANIFEST_FILE in entries or RUN_MARKER not in entries:
            return False
        marker = self._marker()
        if marker is None:  # listed, gone since: its run published or staged again (it held the lock, which
            return True     # orders this run after it; `stage` looks again under the lock)
        foreign = sorted(e for e in entries if not _bookkeeping(e) and e not in marker["claimed"])
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            raise CheckpointError(
                f"{self.url}: holds {', '.join(foreign[:3])}{more} beside an unfinished ckptflow merge, which did not "
                f"write them (its {RUN_MARKER} does not name them); ckptflow replaces only its own files: move them "
                "away or choose another --target_dir")
        return True

    def _marker(self) -> dict | None:
        """The run's marker at the target, or None when there is none. An object at its name that is not a marker
        ckptflow wrote is refused: nothing there can be told apart from someone else's files."""
        fs, root = self._fs_root
        try:
            marker = json.loads(fs.cat_file(posixpath.join(root, RUN_MARKER)))
        except FileNotFoundError:
            return None
        except ValueError:
            marker = None
        if not (isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT
                and isinstance(marker.get("claimed"), list)):
            raise CheckpointError(f"{self.location.join(RUN_MARKER)}: is not a staging marker ckptflow wrote, so the "
                                  "files beside it cannot be told from someone else's; remove it (and what it "
                                  "stands for), or choose another --target_dir")
        return marker

    def claim(self, names: list[str], staged: Staged) -> dict:
        """The marker of the run that staged `staged` (same merge; same run when `staged` says which), naming
        `names` too: added, before they are written, when missing. Refused when the marker is gone or another's:
        another run took the target over, or published, since this one staged, and nothing more is written."""
        marker = self._marker()
        if marker is None or marker.get("weights_id") != staged.weights_id or \
                (staged.run or marker.get("run")) != marker.get("run"):
            raise CheckpointError(f"{self.url}: its {RUN_MARKER} is gone or another run's since this merge staged "
                                  "(another ckptflow run took the target over or published it); nothing more was "
                                  "written: merge again")
        missing = sorted(set(names) - set(marker["claimed"]))
        if missing:
            marker = {**marker, "claimed": sorted({*marker["claimed"], *missing})}
            self._write_marker(marker)
        return marker

    def _write_marker(self, marker: dict) -> None:
        fs, root = self._fs_root
        fs.pipe_file(posixpath.join(root, RUN_MARKER), json.dumps(marker, indent=1).encode())

    def repair(self) -> None:
        """Remove the marker and records a crash left beside a published model (after its manifest was written, or
        before the old one was deleted): the model stands, and the prefix holds nothing but it."""
        entries = self.entries() or []
        if MANIFEST_FILE in entries:
            fs, root = self._fs_root
            for name in sorted(filter(_bookkeeping, entries)):
                fs.rm_file(posixpath.join(root, name))

    def manifest(self) -> dict | None:
        """The target's manifest, or None when it holds no published model."""
        return load_manifest(self.location) if self.location.join(MANIFEST_FILE).exists() else None

    def begin_run(self, merge_id: str, planned: dict[str, int]) -> Staged:
        """A run of merge `merge_id` (its weight files and their sizes: `planned`) begins. Its marker is written
        first, naming the planned weight files and everything the target holds now
        (`check` let this run replace it: a model ckptflow published, with overwrite, or an earlier run's leftovers,
        which that run's marker named). Then its old manifest is deleted (readers see no model from here on), and
        `created` lists the weight files to write: all but those an interrupted run of this merge finished (their
        receipts are in `kept`). `run` says which run staged: only it publishes."""
        fs, root = self._fs_root
        entries = self.entries() or []
        run = uuid.uuid4().hex
        self._write_marker({"format": MARKER_FORMAT, "run": run, "weights_id": merge_id, "host": socket.gethostname(),
                            "pid": os.getpid(), "planned": dict(planned),
                            "claimed": sorted({*(e for e in entries if not _bookkeeping(e)), *planned})})
        if MANIFEST_FILE in entries:
            fs.rm_file(posixpath.join(root, MANIFEST_FILE))  # the old model stops being one before any file changes
        kept = self._finished_files(list(planned), merge_id)
        return Staged(self.url, created=[f for f in planned if f not in kept], kept=kept, weights_id=merge_id, run=run)

    def discard(self) -> None:
        """Nothing to remove: files written so far stay recorded, so the next run of this merge resumes."""

    def _finished_files(self, files: list[str], merge_id: str) -> dict[str, dict]:
        """{file: receipt} of the weight files already written and checked for merge `merge_id`: recorded, and the
        stored object is still the one recorded (same size and ETag)."""
        fs, root = self._fs_root
        fs.invalidate_cache(root)
        records = posixpath.join(root, STAGING_RECORDS)
        kept = {}
        for file in files:
            try:
                record = json.loads(fs.cat_file(posixpath.join(records, f"{file}.json")))
                stored = fingerprint_of(fs.info(posixpath.join(root, file)))
            except (FileNotFoundError, ValueError):
                continue
            receipt = record.get("receipt", {}) if isinstance(record, dict) else {}
            if record.get("weights_id") == merge_id and receipt.get("identity") == stored and "pieces" in receipt:
                kept[file] = receipt  # written, stored and checked (one written without the check is written again)
        return kept

    def record(self, file: str, staged: Staged, receipt: dict) -> None:
        """Record weight file `file` as written and checked by the run `staged` (a rerun of this merge keeps it)."""
        fs, root = self._fs_root
        record = {"weights_id": staged.weights_id, "receipt": receipt}
        fs.pipe_file(posixpath.join(root, STAGING_RECORDS, f"{file}.json"), json.dumps(record).encode())

    def stored_identity(self, file: str) -> dict | None:
        """The stored object's identity (size and ETag, `storage.fingerprint_of`), or None when it is missing."""
        fs, root = self._fs_root
        path = posixpath.join(root, file)
        fs.invalidate_cache(path)
        try:
            return fingerprint_of(fs.info(path))
        except FileNotFoundError:
            return None

    def publish_folder(self, folder: Path, keep: set[str], staged: Staged) -> None:
        """Name `folder`'s files in the run's marker, upload them, remove every other object the marker names but
        `keep` (an earlier model's, an earlier run's), the manifest last, then the records and the marker (kept
        until then: a crash before the manifest resumes with them). An object the marker does not name (put there
        by someone during the merge) is never removed: nothing is published then."""
        fs, root = self._fs_root
        local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        marker = self.claim(local, staged)
        for name in local:
            if name != MANIFEST_FILE:
                fs.put_file(str(folder / name), posixpath.join(root, name))
        entries = self.entries() or []
        leftovers = {name for name in entries if not _bookkeeping(name)} - set(local) - keep
        foreign = sorted(leftovers - set(marker["claimed"]))
        if foreign:
            raise CheckpointError(f"{self.url}: {', '.join(foreign[:3])} appeared during the merge and is not "
                                  "ckptflow's; nothing was published: move it away, then merge again")
        for stale in sorted(leftovers):
            fs.rm_file(posixpath.join(root, stale))
        fs.put_file(str(folder / MANIFEST_FILE), posixpath.join(root, MANIFEST_FILE))
        for name in sorted(name for name in entries if name.startswith(STAGING_RECORDS + "/")) + [RUN_MARKER]:
            fs.rm_file(posixpath.join(root, name))

    @contextmanager
    def local_copy(self):
        """The published model's files in a temporary local folder (each checked for its size), removed afterwards.
        A target without a manifest is refused: it is not a model (an interrupted or ongoing merge)."""
        manifest = self.require_manifest()
        fs, root = self._fs_root
        with tempfile.TemporaryDirectory(prefix="ckptflow-remote-") as scratch:
            folder = Path(scratch) / self.location.name
            for name, entry in manifest["files"].items():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(posixpath.join(root, name), str(folder / name))
                if (folder / name).stat().st_size != entry["size"]:
                    raise VerificationError(f"{self.url}/{name}: differs from {MANIFEST_FILE} (size); the model "
                                            "changed after it was published (merge again with overwrite)")
            fs.get_file(posixpath.join(root, MANIFEST_FILE), str(folder / MANIFEST_FILE))
            yield folder
