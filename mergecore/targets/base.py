"""What every target is and checks before anything is written: it does not overlap the checkpoint, and it replaces
only an empty place or a model ckptflow published (one holding `ckptflow_manifest.json`)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import CheckpointError
from ..model.manifest import MANIFEST_FILE
from ..storage import Location


@dataclass(frozen=True)
class Staged:
    """Where a merge writes, as `Assembly.stage` prepared it (`mergecore.assembly`): plain values, so it travels along the pipeline's edges.

    `staging`: the staged place (a hidden folder beside a local target; the target's URL on object storage);
    `created`: the weight files to write anew (the others hold a finished run's bytes); `published`: the target
    already holds this very merge (nothing to write); on object storage, `weights_id` and `run` (this run's marker)
    and `kept` (receipts of files an interrupted run of this merge finished)."""

    staging: str
    created: list[str] = field(default_factory=list)
    published: bool = False
    weights_id: str | None = None
    run: str | None = None
    kept: dict[str, dict] = field(default_factory=dict)


class Target:
    """A place a merged model is published at: storage only (see `mergecore.targets`). Subclasses say how. What is
    written there and how it is proven is `mergecore.assembly`'s business."""

    url: str
    results_folder: Path  # where the pipeline keeps this target's cached results (a local folder)
    unit: str  # what one writer writes: "groups" (rows at offsets of staged files) or "files" (each streamed whole)

    def __str__(self) -> str:
        return self.url

    def lock(self) -> AbstractContextManager:
        raise NotImplementedError

    def entries(self) -> list[str] | None:
        """Names below the target (None: it does not exist)."""
        raise NotImplementedError

    def unfinished(self, entries: list[str]) -> bool:
        """Whether `entries` are an unfinished merge of ckptflow's and nothing else (resumed or replaced without
        asking). A target whose runs leave their leftovers in it (object storage) says so from what a run recorded
        before its first write, never from names alone, and raises for files beside them that no run wrote."""
        return False

    def manifest(self) -> dict | None:
        """The published model's manifest, or None when the target holds none."""
        raise NotImplementedError

    def open_staging(self, fresh: bool = False):
        raise CheckpointError(f"{self.url}: a folder written in one piece (a LoRA adapter) goes to a local folder "
                              "only; give a local --target_dir and copy it up")

    def discard(self) -> None:
        """What a failed or interrupted merge leaves is removed (or kept to resume from, where the target says so)."""

    def repair(self) -> None:
        """Finish what a crash during an earlier publish left (nothing to do by default)."""

    def local_copy(self) -> AbstractContextManager[Path]:
        """The published model's files as a local folder (for loaders that read only folders)."""
        raise NotImplementedError

    def check(self, overwrite: bool, sources: Iterable[str] = ()) -> None:
        """Refuse, before anything is read or written: a target that is, contains or lies inside a checkpoint
        folder in `sources`; a non-empty target without `overwrite`; and, even with it, one that holds anything
        but a model ckptflow published or an unfinished merge of its own (`unfinished`). It only looks (repairs
        happen when a merge stages, under the lock), so it may run before the lock is taken."""
        for source in sources:
            check_apart(self.url, source)
        self.check_replaceable(overwrite)

    def check_replaceable(self, overwrite: bool) -> None:
        """The target is empty, an unfinished merge of ckptflow's, or (with `overwrite`) a model ckptflow published."""
        entries = self.entries()
        if not entries or self.unfinished(entries):
            return
        if MANIFEST_FILE not in entries:
            raise CheckpointError(
                f"{self.url}: holds files that are not a model ckptflow published (no {MANIFEST_FILE}); ckptflow "
                "replaces only an empty folder or its own model: choose another --target_dir or empty it")
        if not overwrite:
            raise CheckpointError(f"{self.url}: already exists and is not empty; pass --overwrite or choose another "
                                  "--target_dir")

    def require_manifest(self) -> dict:
        """The published model's manifest; a target without one is no model (an interrupted or ongoing merge)."""
        manifest = self.manifest()
        if manifest is None:
            raise CheckpointError(f"{self.url}: holds no {MANIFEST_FILE}, so no published model (an interrupted or "
                                  "ongoing merge); merge it again")
        return manifest


def check_apart(target: str, source: str) -> None:
    """Refuse a `target` that is, contains or lies inside the checkpoint folder `source` (local paths after
    resolving links and `..`; URLs after normalising their paths): publishing there would replace training files.

    >>> check_apart("/ckpts/run1/model", "/ckpts/run1")
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: /ckpts/run1/model: lies inside the checkpoint /ckpts/run1 (publishing there would replace training files); choose a --target_dir outside it
    """
    placed_target, placed_source = _comparable(target), _comparable(source)
    if placed_target is None or placed_source is None or placed_target[0] != placed_source[0]:
        return
    t, s = placed_target[1], placed_source[1]
    relation = ("is the checkpoint" if t == s else "lies inside the checkpoint" if _below(t, s)
                else "contains the checkpoint" if _below(s, t) else None)
    if relation:
        raise CheckpointError(f"{target}: {relation} {source} (publishing there would replace training files); "
                              "choose a --target_dir outside it")


def _comparable(place: str) -> tuple[str, str] | None:
    """(where, normalised path): `("", realpath)` for a local path, `("s3://bucket", /path)` for a URL."""
    location = Location.of(place)
    if location.is_local:
        return "", os.path.realpath(location.url.removeprefix("file://"))
    parts = urlsplit(location.url)
    return f"{parts.scheme}://{parts.netloc}", posixpath.normpath("/" + parts.path.lstrip("/"))


def _below(inner: str, outer: str) -> bool:
    return inner != outer and inner.startswith(outer.rstrip("/") + "/")
