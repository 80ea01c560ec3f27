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
from ..model.folder import PARTIAL_SUFFIX, STAGING_MARKER
from ..model.manifest import MANIFEST_FILE, load_manifest
from .base import Target
from .lock import target_lock
from .publish import publish, repair_target


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

    def publish(self, staging: Path, overwrite: bool) -> None:
        """Make the finished staging folder the target, atomically (see `publish.py`)."""
        (Path(staging) / STAGING_MARKER).unlink(missing_ok=True)
        publish(Path(staging), self.path, overwrite)

    @contextmanager
    def local_copy(self):
        """The published model as a local folder: the target itself."""
        yield self.path


def _missing_parents(path: Path) -> list[Path]:
    """Folders above `path` that do not exist yet, deepest first."""
    missing = []
    for parent in path.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


