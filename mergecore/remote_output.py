"""Merged models on object storage (`s3://...` and any fsspec URL): written in order, published by the manifest.

Object stores have no rename, so a folder cannot appear at once. The rule instead (docs/remote_targets.md):
**a folder is a model only while it holds `ckptflow_manifest.json`, and only the files the manifest lists,
with the sizes and sha256 it records, are that model.** A merge into a remote target therefore

1. merges into a local shadow folder (the cache folder, named after the target URL) with the usual
   machinery: groups land at their planned offsets, an interrupted merge resumes there, the round-trip
   check runs before anything leaves the machine;
2. deletes the target's old manifest (from here on readers see no model, never a mix);
3. uploads the weight files in plan order, then every other file, index included, each as one object
   (s3fs streams it as a multipart upload: an object is visible whole or not at all);
4. removes objects of an earlier model that the new one does not have;
5. writes the manifest last: that PUT publishes the model.

A crash before step 5 leaves no manifest: no model, and the next merge overwrites what was uploaded.

>>> merge_checkpoint("s3://ckpts/run1", "s3://models/run1-step100")  # doctest: +SKIP
"""

from __future__ import annotations

import posixpath
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import CheckpointError, VerificationError
from .output import MANIFEST_FILE
from .storage import Location, default_cache_dir


def is_remote(target) -> bool:
    """Whether `target` names a folder behind a non-local fsspec URL."""
    return not Location.of(target).is_local


def shadow_folder(target: Location) -> Path:
    """The local folder a merge into remote `target` is assembled in, fixed per URL so a crash can resume."""
    return default_cache_dir() / "targets" / f"{target._url_key()}-{target.name}"


def remote_manifest(target: Location) -> dict | None:
    """The target's manifest, or None when it holds no published model."""
    from .tensorio import read_json

    manifest_file = target.join(MANIFEST_FILE)
    return read_json(manifest_file, fix="merge again with --overwrite") if manifest_file.exists() else None


def _objects(target: Location) -> list[str]:
    """Paths (relative to `target`) of every object below it."""
    fs, root = target._fs_path
    fs.invalidate_cache(root)
    if not fs.isdir(root):
        return []
    return sorted(posixpath.relpath(path, root) for path in fs.find(root))


def check_remote_target(target: Location, overwrite: bool) -> None:
    """Refuse a non-empty remote target unless `overwrite` (nothing is read or written yet)."""
    if not overwrite and _objects(target):
        raise CheckpointError(f"{target}: already holds objects; pass --overwrite or choose another --target_dir")


def upload_model(folder: Path, target: Location, weight_files: list[str]) -> None:
    """Publish the finished local `folder` at `target`: old manifest deleted first, weights in plan order,
    then the other files, stale objects removed, and the manifest last."""
    fs, root = target._fs_path
    manifest_object = posixpath.join(root, MANIFEST_FILE)
    if fs.exists(manifest_object):
        fs.rm_file(manifest_object)  # the old model stops being a model before any of its files change
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    others = [name for name in local if name not in weight_files and name != MANIFEST_FILE]
    for name in [*weight_files, *others]:
        fs.put_file(str(folder / name), posixpath.join(root, name))
    for stale in set(_objects(target)) - set(local):
        fs.rm_file(posixpath.join(root, stale))
    fs.put_file(str(folder / MANIFEST_FILE), manifest_object)


def merge_to_remote(checkpoint: str, target: str, *, overwrite: bool = False, prepared=None, **options) -> dict:
    """`merge_checkpoint` into a remote folder: merged and verified in the local shadow folder, then
    uploaded manifest last (see the module doc). A target already holding this very merge is kept as is."""
    from .merge import merge_checkpoint, prepare
    from .fingerprints import weights_id

    location = Location.of(target)
    prepare_keys = ("role", "backend", "hf_dir", "dtype", "max_shard_size", "tie_word_embedding", "check_replicas")
    prepared = prepared or prepare(checkpoint, **{k: options[k] for k in prepare_keys if k in options})
    published = remote_manifest(location)
    if published and published.get("weights_id") == weights_id(prepared.source, prepared.plan):
        return {**published, "reused": True}
    check_remote_target(location, overwrite)
    shadow = shadow_folder(location)
    shadow.parent.mkdir(parents=True, exist_ok=True)
    manifest = merge_checkpoint(checkpoint, shadow, overwrite=True, prepared=prepared, **options)
    upload_model(shadow, location, list(prepared.plan.files))
    shutil.rmtree(shadow, ignore_errors=True)
    return manifest


@contextmanager
def downloaded(target: str):
    """A local copy of the published model at remote `target` (the manifest's files only, each checked for its
    size), in a temporary folder removed afterwards; a local `target` is given as it is.

    A folder without a manifest is refused: it is not a model (an interrupted or ongoing merge).
    """
    location = Location.of(target)
    if location.is_local:
        yield Path(location.url)
        return
    manifest = remote_manifest(location)
    if manifest is None:
        raise CheckpointError(f"{target}: holds no {MANIFEST_FILE}, so no published model (an interrupted or ongoing "
                              "merge); merge it again")
    fs, root = location._fs_path
    with tempfile.TemporaryDirectory(prefix="ckptflow-remote-") as scratch:
        folder = Path(scratch) / location.name
        for name, entry in manifest["files"].items():
            if name.startswith("/") or ".." in name.split("/"):
                raise VerificationError(f"{target}/{MANIFEST_FILE}: names {name}, outside the folder")
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(posixpath.join(root, name), str(folder / name))
            if (folder / name).stat().st_size != entry["size"]:
                raise VerificationError(f"{target}/{name}: differs from {MANIFEST_FILE} (size); the model changed "
                                        "after it was published (merge again with overwrite)")
        fs.get_file(posixpath.join(root, MANIFEST_FILE), str(folder / MANIFEST_FILE))
        yield folder


def finalize_remote(prepared, staging: Path, target: str, **finalize_options) -> dict:
    """`merge.finalize` for a remote target: the staged groups are verified and finished into the target's
    shadow folder, then uploaded manifest last. `staging` is where `merge.stage` put them for this target."""
    from .merge import finalize

    location = Location.of(target)
    shadow = shadow_folder(location)
    manifest = finalize(prepared, staging, shadow, overwrite=True, **finalize_options)
    upload_model(shadow, location, list(prepared.plan.files))
    shutil.rmtree(shadow, ignore_errors=True)
    return manifest
