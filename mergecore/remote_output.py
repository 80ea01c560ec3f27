"""Merged models on object storage (`s3://...` and any fsspec URL): written file by file, published by the manifest.

Object stores have no rename, so a folder cannot appear at once. The rule instead (docs/remote_targets.md):
**a folder is a model only while it holds `ckptflow_manifest.json`, and only the files the manifest lists,
with the sizes and sha256 it records, are that model.** A merge into a remote target therefore

1. stages (`stage_remote`): deletes the target's old manifest, so from here on readers see no model, never
   a mix; weight files finished by an interrupted run of this very merge are kept (their records, under
   `.ckptflow-staging/`, match the merge and the stored objects);
2. streams each remaining weight file to its final name, reads it back and proves it against the shards
   (`remote_writer.write_remote_file`; any machine can write any file, so a cluster writes them in parallel)
   and records it;
3. finishes (`finalize_remote`): uploads the index, config, copied files and card, removes objects an
   earlier model had and the staging records, and writes the manifest last: that PUT publishes the model.

A crash before the manifest leaves no model, and the next merge resumes from the recorded files.

>>> merge_checkpoint("s3://ckpts/run1", "s3://models/run1-step100")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import posixpath
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .errors import CheckpointError, VerificationError
from .output import MANIFEST_FILE
from .storage import Location, _identity, default_cache_dir

STAGING_RECORDS = ".ckptflow-staging"  # under a remote target: one record per finished file, gone once published


def is_remote(target) -> bool:
    """Whether `target` names a folder behind a non-local fsspec URL."""
    return not Location.of(target).is_local


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
    """Refuse a non-empty remote target unless `overwrite` (nothing is read or written yet). A target holding an
    unfinished merge (staging records and no manifest) is no model: it is resumed or replaced without asking."""
    objects = _objects(target)
    unfinished = MANIFEST_FILE not in objects and any(o.startswith(STAGING_RECORDS + "/") for o in objects)
    if objects and not (overwrite or unfinished):
        raise CheckpointError(f"{target}: already holds objects; pass --overwrite or choose another --target_dir")


def local_state_folder(target: str | Location) -> Path:
    """The local folder for a remote target's run state (the pipeline's cached results and locks): fixed per URL."""
    location = Location.of(target)
    return default_cache_dir() / "targets" / f"{location._url_key()}-{location.name}"


def stage_remote(prepared, target: str, overwrite: bool) -> dict:
    """Make remote `target` ready for the weight files of `prepared`, like `merge.stage` for a folder:
    `published` when it already holds this very merge (nothing to write); else its old manifest is deleted
    and `created` lists the weight files to write (all but those an interrupted run of this merge finished:
    their receipts are in `kept`). A different non-empty target needs `overwrite`."""
    from .fingerprints import weights_id

    location = Location.of(target)
    merge_id = weights_id(prepared.source, prepared.plan)
    published = remote_manifest(location)
    if published and published.get("weights_id") == merge_id:
        return {"staging": location.url, "created": [], "kept": {}, "published": True, "weights_id": merge_id}
    check_remote_target(location, overwrite)
    fs, root = location._fs_path
    if published:
        fs.rm_file(posixpath.join(root, MANIFEST_FILE))  # the old model stops being one before any file changes
    kept = finished_files(location, prepared.plan.files, merge_id)
    return {"staging": location.url, "created": [f for f in prepared.plan.files if f not in kept], "kept": kept,
            "published": False, "weights_id": merge_id}


def finished_files(target: Location, files: list[str], merge_id: str) -> dict[str, dict]:
    """{file: receipt} of the weight files already written and checked for merge `merge_id`: recorded, and the
    stored object is still the one recorded (same size and ETag)."""
    fs, root = target._fs_path
    fs.invalidate_cache(root)
    records = posixpath.join(root, STAGING_RECORDS)
    kept = {}
    for file in files:
        try:
            record = json.loads(fs.cat_file(posixpath.join(records, f"{file}.json")))
            stored = _identity(fs.info(posixpath.join(root, file)))
        except (FileNotFoundError, ValueError):
            continue
        receipt = record.get("receipt", {})
        if record.get("weights_id") == merge_id and receipt.get("identity") == stored and "pieces" in receipt:
            kept[file] = receipt  # written, stored and checked (one written without the check is written again)
    return kept


def record_finished(target: str | Location, merge_id: str, receipt: dict) -> None:
    """Record a weight file written and checked for merge `merge_id`, so an interrupted merge keeps it."""
    fs, root = Location.of(target)._fs_path
    record = {"weights_id": merge_id, "receipt": receipt}
    fs.pipe_file(posixpath.join(root, STAGING_RECORDS, f"{receipt['file']}.json"), json.dumps(record).encode())


def write_file(prepared, target: str, file: str, merge_id: str, **options) -> dict:
    """Write, check and record one weight file of `prepared`'s plan at remote `target` (see remote_writer)."""
    from .remote_writer import write_remote_file

    receipt = write_remote_file(prepared.source, prepared.plan, file, target, **options)
    record_finished(target, merge_id, receipt)
    return receipt


def check_sizes(target: str | Location, manifest: dict) -> dict:
    """The cheap check of a published remote model (no byte read): every file the manifest lists is there with
    its size; `ckptflow verify` re-hashes everything. Returns the result row."""
    from .verify import file_changed, file_missing

    location = Location.of(target)
    fs, root = location._fs_path
    fs.invalidate_cache(root)
    for name, entry in manifest["files"].items():
        try:
            size = fs.info(posixpath.join(root, name))["size"]
        except FileNotFoundError:
            raise file_missing(location.join(name)) from None
        if size != entry["size"]:
            raise file_changed(location.join(name))
    return {"check": "manifest (size)", "files": len(manifest["files"]), "ok": True}


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


def merge_to_remote(checkpoint: str, target: str, *, overwrite: bool = False, prepared=None, verify: bool = True,
                    workers: int = 2, on_group=None, on_tensor=None, checks=None, on_nonfinite: str = "warn",
                    chunk_bytes: int | str | None = None, **prepare_options) -> dict:
    """`merge_checkpoint` into a remote folder (see the module doc): `workers` files are written at once, each
    streamed, read back and checked; `on_group(file, receipt)` follows the files. A target already holding
    this very merge is kept as it is."""
    from .merge import prepare

    prepared = prepared or prepare(checkpoint, **prepare_options)
    staged = stage_remote(prepared, target, overwrite)
    if staged["published"]:
        return {**remote_manifest(Location.of(target)), "reused": True}

    def one(file: str) -> dict:
        receipt = write_file(prepared, target, file, staged["weights_id"], on_nonfinite=on_nonfinite,
                             chunk_bytes=chunk_bytes, verify=verify, on_tensor=on_tensor)
        if on_group:
            on_group(file, receipt)
        return receipt

    with ThreadPoolExecutor(max(1, workers)) as pool:
        written = {r["file"]: r for r in pool.map(one, staged["created"])}
    receipts = [staged["kept"].get(f) or written[f] for f in prepared.plan.files]
    return finalize_remote(prepared, target, receipts, verify=verify, checks=checks)


def finalize_remote(prepared, target: str, receipts: list[dict], *, verify: bool = True, extra: dict | None = None,
                    checks=None) -> dict:
    """Publish the weight files written to remote `target` (one receipt each): the files are still the ones
    written; index, config, copied files, a LoRA adapter and the card go up; objects of an earlier model and the
    staging records go; the manifest is written last. `checks(folder)` (a reference's tensors and logits) runs on
    a local copy before anything is published. A target already holding this merge is kept as it is."""
    from .fingerprints import metadata_id, weights_id
    from .lora import write_adapter_beside
    from .output import write_descriptive_files, write_manifest

    location = Location.of(target)
    plan, merge_id = prepared.plan, weights_id(prepared.source, prepared.plan)
    published = remote_manifest(location)
    if published and published.get("weights_id") == merge_id:
        return {**published, "reused": True}
    fs, root = location._fs_path
    by_file = {r["file"]: r for r in receipts}
    for file in plan.files:
        fs.invalidate_cache(posixpath.join(root, file))
        if file not in by_file or _identity(fs.info(posixpath.join(root, file))) != by_file[file]["identity"]:
            raise VerificationError(f"{location.join(file)}: not the file this merge wrote (missing or replaced since); "
                                    "nothing was published: merge again")
    results = [{"check": "round-trip", "tensors": len(prepared.source.tensors()),
                "pieces": sum(by_file[f]["pieces"] for f in plan.files), "ok": True}] if verify else []
    with tempfile.TemporaryDirectory(prefix="ckptflow-publish-") as scratch:
        folder = Path(scratch)
        descriptive = write_descriptive_files(prepared.source, prepared.config, plan, folder)
        descriptive += write_adapter_beside(prepared.source, folder)
        if checks:
            for file in plan.files:
                fs.get_file(posixpath.join(root, file), str(folder / file))
            results += checks(folder)
            for file in plan.files:
                (folder / file).unlink()
        extra = {**(extra or {}), "groups_written": receipts, "verification": results, "weights_id": merge_id,
                 "source": {**prepared.source.describe(), "options": prepared.options},
                 "metadata_id": metadata_id(prepared.source, prepared.config)}
        stored = {f: {"sha256": by_file[f]["sha256"], "size": by_file[f]["size"]} for f in plan.files}
        manifest = write_manifest(prepared.source, prepared.config, plan, folder, descriptive, extra, stored=stored)
        local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        for name in local:
            if name != MANIFEST_FILE:
                fs.put_file(str(folder / name), posixpath.join(root, name))
        leftovers = set(_objects(location)) - set(local) - set(plan.files)
        records = {name for name in leftovers if name.startswith(STAGING_RECORDS + "/")}
        for stale in sorted(leftovers - records):  # an earlier model's files
            fs.rm_file(posixpath.join(root, stale))
        fs.put_file(str(folder / MANIFEST_FILE), posixpath.join(root, MANIFEST_FILE))
        for record in sorted(records):  # kept until the model is published: a crash before resumes with them
            fs.rm_file(posixpath.join(root, record))
    return manifest
