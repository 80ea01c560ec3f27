"""A merged folder's manifest (`ckptflow_manifest.json`): the sha256 and size of every file the folder publishes,
where the weights came from and how they were proven. Written last into a staging folder; read back by every rerun
and by `verify`. A folder holds exactly the files its manifest lists, and the manifest.

The check that a model's files are still its manifest's is the proofs' (`proofs.reader.check_manifest`).

>>> sorted(load_manifest("out/model")["files"])[:2]  # doctest: +SKIP
['README.md', 'config.json']
"""

from __future__ import annotations

import datetime
import hashlib
import json
from importlib import metadata
from pathlib import Path

from ..errors import CheckpointError, VerificationError
from ..storage import Location
from ..storage.ledger import remember, split_private
from ..storage.tensorio import read_json
from .card import CARD_FILE, model_card
from .folder import STAGING_MARKER

MANIFEST_FILE = "ckptflow_manifest.json"


def ckptflow_version() -> str:
    try:
        return metadata.version("ckptflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(fields: dict, config: dict, folder: Path, files: list[str], known: dict[str, str] | None = None,
                   stored: dict[str, dict] | None = None) -> dict:
    """The model card, then the manifest: `fields` (source, dtype, groups, proofs... as the merge describes them)
    and the sha256 of every file the folder publishes, which must be exactly `files` (weights, descriptive files)
    and the card.

    `known` holds sha256 digests already computed (the weight files, hashed while merging). `stored` holds the
    entries ({"sha256", "size"}) of files published elsewhere than `folder` (weights already on object storage).
    """
    manifest = {"ckptflow_version": ckptflow_version(),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **fields}
    # the manifest and card travel with the model: they name its sources publicly, this machine's ledger keeps
    # the full paths for `verify` (storage/ledger.py)
    manifest["source"], private = split_private(manifest["source"])
    stored = stored or {}
    (folder / CARD_FILE).write_text(model_card(manifest, config, manifest.get("verification", [])))
    files = sorted({*files, CARD_FILE})
    present = sorted({*stored, *(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                                 if not p.is_dir() and p.name != STAGING_MARKER)})
    if present != files:  # lora_adapter/ files count too
        raise VerificationError(f"{folder}: holds {sorted(set(present) ^ set(files))} beside or instead of the planned "
                                "files; nothing was published: merge again")
    digests = dict(known or {})
    digests.update({name: sha256_file(folder / name) for name in files if name not in digests and name not in stored})
    manifest["files"] = {name: stored.get(name) or {"sha256": digests[name], "size": (folder / name).stat().st_size,
                                                     "mtime_ns": (folder / name).stat().st_mtime_ns} for name in files}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    remember(manifest.get("weights_id"), private)
    return manifest


def file_missing(path) -> VerificationError:
    return VerificationError(f"{path}: listed in {MANIFEST_FILE} but missing; the folder is incomplete")


def file_changed(path, why: str | None = None) -> VerificationError:
    """A published file that is not what its merge wrote: by its hash (`why` None) or by what it holds."""
    return VerificationError(f"{path}: {why or f'differs from {MANIFEST_FILE}'}; the file changed after the merge "
                             "(merge again with overwrite)")


def _inside_folder(name: str) -> bool:
    """A manifest file name: a plain name, or one folder deep (a LoRA merge's `lora_adapter/...`); never `..`."""
    parts = name.split("/")
    return len(parts) <= 2 and all(part not in ("", ".", "..") for part in parts)


def load_manifest(folder) -> dict:
    """A merged folder's manifest, checked for the fields `verify` reads (`folder`: a path or a `storage.Location`)."""
    path = folder.join(MANIFEST_FILE) if isinstance(folder, Location) else Path(folder) / MANIFEST_FILE
    fix = "the folder was not written by ckptflow merge, or its manifest was damaged: merge again"
    manifest = read_json(path, fix=fix)
    files, source = manifest.get("files"), manifest.get("source")
    if not (isinstance(files, dict) and all(isinstance(e, dict) and "sha256" in e and "size" in e for e in files.values())
            and all(isinstance(name, str) and _inside_folder(name) for name in files)
            and isinstance(source, dict) and isinstance(source.get("location"), str)
            and isinstance(source.get("options", {}), dict) and isinstance(manifest.get("aliases", {}), dict)):
        raise CheckpointError(f"{path}: lacks its files or source entries; {fix}")
    return manifest
