"""A local folder as a target: assembled in a hidden staging folder beside it, published by one atomic rename.

Staging (`.NAME.ckptflow-partial`) is created exclusively (`mkdir`, never through an existing link) and marked
with a file ckptflow writes (`.ckptflow-staging`), so a leftover of a crashed run is recognised and resumed, and
anything else found at that name — a link, a file, someone's folder — is refused. The target's path is resolved
first (links and `..`): a target that is a link publishes into the folder it names, and the link stays.

>>> target = LocalTarget("/srv/models/../models/run1")
>>> target.url, target.staging.name
('/srv/models/run1', '.run1.ckptflow-partial')
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from ..model.folder import STAGING_MARKER, clear_strays
from ..model.manifest import MANIFEST_FILE
from .publish import publish, repair_target
from ..engine.writer import PARTIAL_SUFFIX, METADATA_SLACK, prepare_files
from .base import Staged, Target
from .lock import target_lock



class LocalTarget(Target):
    unit = "groups"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.path.realpath(os.path.expanduser(os.fspath(path))))
        self.url = str(self.path)
        self.staging = self.path.parent / f".{self.path.name}{PARTIAL_SUFFIX}"
        self.lock_file = self.path.parent / f".{self.path.name}.ckptflow-lock"
        self.results_folder = self.path.parent / f".{self.path.name}.ckptflow-results"  # the pipeline's cached results

    @contextmanager
    def lock(self, timeout: float | None = None):
        """The target's lock (see `lock.py`). Folders above the target made for it are removed again when no
        model was published, so a refused or interrupted merge leaves nothing behind."""
        made = _missing_parents(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with target_lock(self.lock_file, self.url, timeout):
                yield self
        finally:
            if not os.path.lexists(self.path):
                for folder in made:  # deepest first
                    try:
                        folder.rmdir()
                    except OSError:
                        break

    def entries(self) -> list[str] | None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"{self.path}: is a file, not a folder; choose another --target_dir")
        return os.listdir(self.path)

    def repair(self) -> None:
        """Put back a model a crash took away mid-publish (`publish.repair_target`), and remove a finished model a
        crash left under the staging name (never resumed from)."""
        repair_target(self.path)
        if self._staging_state() == "finished":
            shutil.rmtree(self.staging)

    def _staging_state(self) -> str | None:
        """What the staging name holds: None (nothing), "marked" (a staging folder ckptflow made), "finished" (a
        model a crash left there after or before the swap), "empty" (a bare folder), or "foreign" (a link, a file,
        anyone's folder: never touched)."""
        try:
            mode = os.lstat(self.staging).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            return "foreign"
        names = os.listdir(self.staging)
        return ("finished" if MANIFEST_FILE in names else "marked" if STAGING_MARKER in names
                else "empty" if not names else "foreign")

    def manifest(self) -> dict | None:
        """The published model's manifest, or None when the folder holds none."""
        from ..proofs.verify import load_manifest

        return load_manifest(self.path) if (self.path / MANIFEST_FILE).is_file() else None

    def open_staging(self, fresh: bool = False) -> Path:
        """The staging folder, ready to write into: a crashed run's (marked by us) is reused unless `fresh`; a
        finished model or a bare folder at that name is replaced; anything else there is refused. A new one is
        made with `mkdir`, which never follows or replaces a link."""
        state = self._staging_state()
        if state == "foreign":
            kind = "a link" if os.path.islink(self.staging) else "not marked"
            raise CheckpointError(f"{self.staging}: exists and is not a staging folder ckptflow made ({kind}); "
                                  "remove it, then merge again")
        if state == "marked" and not fresh:
            return self.staging
        if state is not None:
            shutil.rmtree(self.staging)
        os.mkdir(self.staging, 0o755)
        descriptor = os.open(self.staging / STAGING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "w") as marker:
            json.dump({"target": self.url, "pid": os.getpid()}, marker)
        return self.staging

    def discard(self) -> None:
        """Remove the staging folder (a failed or interrupted merge), if it is ours: a real folder we marked."""
        if self._staging_state() == "marked":
            shutil.rmtree(self.staging, ignore_errors=True)

    def _already_published(self, prepared) -> Staged:
        return Staged(str(self.staging), published=True)

    def _stage(self, prepared, room: int) -> Staged:
        """The staging folder with the planned files pre-sized (`created`: made anew, so their groups must be
        written; files kept from an interrupted run keep theirs); refused first when they would not fit with
        `room` bytes for the rest."""
        staging = self.open_staging()
        return Staged(str(staging), created=prepare_files(prepared.plan, staging, room or METADATA_SLACK))

    def publish(self, staging: Path, overwrite: bool) -> None:
        """Make the finished staging folder the target, atomically (see `publish.py`)."""
        (Path(staging) / STAGING_MARKER).unlink(missing_ok=True)
        publish(Path(staging), self.path, overwrite)

    @contextmanager
    def local_copy(self):
        """The published model as a local folder: the target itself."""
        yield self.path

    def check_published(self, manifest: dict) -> dict:
        """The cheap check of the published model: sizes and modification times (`verify` re-hashes)."""
        from ..proofs.verify import verify_manifest

        return verify_manifest(self.path, full=False)

    def hashes(self, staged: Staged):
        from ..engine.hashes import BackgroundHashes

        return BackgroundHashes(Path(staged.staging))  # the staged files, as far as their groups are written

    def write_unit(self, prepared, group: str, staged: Staged, workers: int = 1, on_nonfinite: str = "warn",
                   on_tensor=None, chunk_bytes=None) -> dict:
        """Merge one layer group into its place in the staged files; returns its receipt (`merge.merge_group`)."""
        from ..engine.merge import merge_group

        staging = Path(staged.staging)
        if not staging.is_dir():
            raise CheckpointError(f"{staging}: staging folder is gone and group {group} has no cached result; "
                                  "rerun with overwrite to rebuild the target")
        return merge_group(prepared.source, prepared.plan, group, staging, workers, on_tensor, on_nonfinite, chunk_bytes)

    def merge(self, prepared, staged: Staged, *, overwrite: bool, verify: bool = True, workers: int = 2,
              on_unit=None, on_tensor=None, on_nonfinite: str = "warn", chunk_bytes=None, extra: dict | None = None,
              checks=None) -> dict:
        """Every group into the staged files, in order, then `finalize`. The weight files are hashed as far as
        they are written while the next groups merge."""
        from ..engine.merge import Stopwatch

        clock, plan = Stopwatch(), prepared.plan
        with self.hashes(staged) as hashes:
            receipts = []
            for group in self.units(plan):
                receipts.append(self.write_unit(prepared, group, staged, workers, on_nonfinite, on_tensor, chunk_bytes))
                hashes.start_written(plan, {r["group"] for r in receipts})
                if on_unit:
                    on_unit(group, receipts[-1])
            clock.lap("merge")
            extra = {**(extra or {}), "timings": {**(extra or {}).get("timings", {}), **clock.laps}}
            return self.finalize(prepared, staged, receipts, overwrite=overwrite, verify=verify, workers=workers,
                                 extra=extra, hashes=hashes, checks=checks)

    def finalize(self, prepared, staged: Staged, receipts: list[dict], *, overwrite: bool, verify: bool = True,
                 workers: int = 2, extra: dict | None = None, hashes=None, checks=None) -> dict:
        """Prove the staged files equal the shards (round trip), add index, config, copied files, card and
        manifest (`merge.finish_folder`, with `checks` of the finished folder), and publish atomically.
        Nothing reaches the target unless every check passed. `hashes`: a `BackgroundHashes` already through
        the groups merged so far."""
        from ..engine.merge import Stopwatch, write_beside_weights, finish_folder
        from ..engine.hashes import BackgroundHashes
        from .publish import start_writeback
        from ..proofs.verify import verify_round_trip
        from ..engine.writer import room_checked

        staging, plan, clock = Path(staged.staging), prepared.plan, Stopwatch()
        with room_checked(staging):
            clear_strays(staging, set(plan.files))
            hashes = hashes or BackgroundHashes(staging)
            hashes.start(plan.files)  # finishes while the round-trip check runs
            descriptive = write_beside_weights(prepared, staging)
            start_writeback([staging / file for file in plan.files])  # to disk while the checks run; publish fsyncs
            results = [verify_round_trip(prepared.source, staging, plan.aliases, workers, plan)] if verify else []
            clock.lap("verify")
            extra = {**(extra or {}), "groups_written": receipts}
            extra["timings"] = {**extra.get("timings", {}), **clock.laps}
            manifest = finish_folder(prepared, staging, descriptive, results, extra, known=hashes.digests(), checks=checks)
            self.publish(staging, overwrite)
        return manifest

    def refresh(self, prepared, *, verify: bool = True, workers: int = 2, checks=None) -> dict:
        """The target holds this merge's weights (`stage` said `published`): reuse them, and republish only when
        config, tokenizer files or card changed — the weights hard-linked into a fresh staging folder, so the
        swap stays atomic and no weight byte is written."""
        from ..engine.fingerprints import metadata_id

        manifest = self.published(prepared, overwrite=False)
        if manifest is None:
            raise CheckpointError(f"{self.url}: does not hold this checkpoint's merge; rerun with overwrite to rebuild it")
        if manifest.get("metadata_id") == metadata_id(prepared.source, prepared.config):
            return {**manifest, "reused": True}
        staging = self.open_staging(fresh=True)
        for file in prepared.plan.files:
            os.link(self.path / file, staging / file)
        return self.finalize(prepared, Staged(str(staging)), manifest.get("groups_written", []), overwrite=True,
                             verify=verify, workers=workers, checks=checks)


def _missing_parents(path: Path) -> list[Path]:
    """Folders above `path` that do not exist yet, deepest first."""
    missing = []
    for parent in path.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


