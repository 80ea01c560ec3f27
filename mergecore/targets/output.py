"""What a merged folder holds beside its weights: index, config, tokenizer and friends, card and manifest (and the
background hashing of the weights). Publishing is the target's (`targets/`)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import threading
from importlib import metadata
from pathlib import Path

from ..numbers.arrays import FLOATING
from .card import CARD_FILE, model_card
from ..errors import VerificationError
from ..formats import CheckpointSource
from ..engine.plan import INDEX_FILE, MergePlan
from ..storage import checked_publishable, link_root, publishable_files
from ..storage.ledger import remember, split_private

MANIFEST_FILE = "ckptflow_manifest.json"
STAGING_MARKER = ".ckptflow-staging"  # in a staging folder ckptflow made (targets/local.py); never published
# Weight files in huggingface/ describe the base model, not the trained one: never copied. Nor is its model
# card: the folder gets its own (card.py).
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")
_NOT_COPIED_NAMES = ("config.json", CARD_FILE, MANIFEST_FILE)


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


def output_config(config: dict, plan: MergePlan) -> dict:
    """config.json as trained, declaring the dtype the weights were written in."""
    config = dict(config)
    floating = [t.dtype for t in plan.tensors if t.dtype in FLOATING]
    written = plan.dtype or max(set(floating), key=floating.count, default=None)
    if written:
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = written
    if plan.quantization:  # how transformers and vLLM read the quantized weights
        config["quantization_config"] = plan.quantization["config"]
    return config


def copy_hf_files(source: CheckpointSource, folder: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template, custom code... from huggingface/: its regular files
    inside the checkpoint (`storage.publishable_files`, checked again here as each is opened), as new files with
    ordinary permissions (the umask's), never the source's mode.

    >>> copy_hf_files(open_checkpoint("ckpts/run1"), Path("out/.model.ckptflow-partial"))  # doctest: +SKIP
    ['generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
    """
    copied = copied_names(source)
    root = link_root(source.hf_dir, source.location) if copied else None
    for name in copied:
        with checked_publishable(source.hf_dir.join(name), root) as src, open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return copied


def copied_names(source: CheckpointSource) -> list[str]:
    """The files of the checkpoint's huggingface/ folder that a merge copies verbatim (and `verify` compares):
    its publishable files (`storage.publishable_files`) but the base model's weights, config.json (rewritten:
    `output_config`), its model card and any manifest.

    >>> copied_names(open_checkpoint("ckpts/run1"))  # doctest: +SKIP
    ['generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
    """
    if source.hf_dir is None:
        return []
    return [name for name in publishable_files(source.hf_dir, source.location)
            if name not in _NOT_COPIED_NAMES and not name.endswith(_NOT_COPIED)]


class BackgroundHashes:
    """sha256 of output files on one background thread. A file is hashed front to back as far as its
    bytes are written (`start_written`), so hashing overlaps with merging instead of following it;
    `start` marks whole files as written.

    >>> hashes = BackgroundHashes(folder); hashes.start(["model-00001-of-00002.safetensors"])  # doctest: +SKIP
    >>> hashes.digests()                                                                  # doctest: +SKIP

    As a context manager it stops its thread on the way out, with whatever work is left abandoned
    (a failed merge, or nothing was ever asked of it).
    """

    _CHUNK = 4 << 20

    def __init__(self, folder: Path):
        self._folder = folder
        self._goal: dict[str, int | None] = {}  # bytes known written; None: the whole file
        self._state: dict[str, tuple] = {}      # file -> (sha256 object, bytes hashed)
        self._done: dict[str, str] = {}
        self._ends: dict[str, tuple[int, list[tuple[str, int]]]] | None = None  # from the plan, on first use
        self._closing = False
        self._error: BaseException | None = None
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def start(self, names: list[str]) -> None:
        with self._wake:
            self._goal.update({name: None for name in names if name not in self._done})
            self._wake.notify()

    def start_written(self, plan: MergePlan, written_groups: set[str]) -> None:
        """Hash each file up to the end of its leading tensors whose groups are written (in any order)."""
        if self._ends is None:  # per file: where the data starts, then (group, end byte) of each tensor in order
            self._ends = {file: (len(plan.header(file)), [(t.group, t.end) for t in plan.in_file(file)])
                          for file in plan.files}
        with self._wake:
            for file, (start, tensors) in self._ends.items():
                if file in self._done or (file in self._goal and self._goal[file] is None):
                    continue
                end, whole = start, True
                for group, tensor_end in tensors:
                    if group not in written_groups:
                        whole = False
                        break
                    end = start + tensor_end
                self._goal[file] = None if whole else max(end, self._goal.get(file) or 0)
            self._wake.notify()

    def digests(self) -> dict[str, str]:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return dict(self._done)

    def abandon(self) -> None:
        """End the thread after its current read, leaving the rest unhashed."""
        with self._wake:
            self._goal.clear()
            self._closing = True
            self._wake.notify()

    def __enter__(self) -> BackgroundHashes:
        return self

    def __exit__(self, *exc) -> None:
        self.abandon()

    def _next(self):
        """A (file, goal) with bytes left to hash, or None."""
        for file, goal in self._goal.items():
            if file not in self._done and (goal is None or goal > self._state.get(file, (None, 0))[1]):
                return file, goal
        return None

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while (work := self._next()) is None and not self._closing:
                        self._wake.wait()
                if work is None:
                    return
                self._advance(*work)
        except BaseException as error:  # noqa: BLE001 - reported by digests()
            self._error = error

    def _advance(self, file: str, goal: int | None) -> None:
        digest, position = self._state.get(file) or (hashlib.sha256(), 0)
        with open(self._folder / file, "rb") as f:
            while goal is None or position < goal:
                block = os.pread(f.fileno(), self._CHUNK if goal is None else min(self._CHUNK, goal - position), position)
                if not block:
                    break
                digest.update(block)
                position += len(block)
        self._state[file] = (digest, position)
        if goal is None:
            self._done[file] = digest.hexdigest()


def clear_strays(folder: Path, keep: set[str]) -> None:
    """Remove every entry of `folder` not named in `keep`: a staging folder publishes exactly what was planned
    (leftovers of a killed run with another shard size, files someone put there)."""
    for entry in folder.iterdir():
        if entry.name not in keep and entry.name != STAGING_MARKER:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def write_descriptive_files(source: CheckpointSource, config: dict, plan: MergePlan, folder: Path) -> list[str]:
    """The index, config.json and the files copied from huggingface/ into `folder`; returns their names."""
    (folder / INDEX_FILE).write_text(json.dumps(plan.index(), indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(output_config(config, plan), indent=2) + "\n")
    return [INDEX_FILE, "config.json", *copy_hf_files(source, folder)]


def write_manifest(source: CheckpointSource, config: dict, plan: MergePlan, folder: Path, descriptive: list[str],
                   extra: dict | None = None, known: dict[str, str] | None = None,
                   stored: dict[str, dict] | None = None) -> dict:
    """The model card, then the manifest: sha256 of every file the folder publishes, which must be exactly
    the planned weight files, `descriptive` (from `write_descriptive_files`) and the card.

    `known` holds sha256 digests already computed (the weight files, hashed while merging). `stored` holds the
    entries ({"sha256", "size"}) of files published elsewhere than `folder` (weights already on object storage).
    """
    manifest = {
        "ckptflow_version": ckptflow_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source.describe(),
        "dtype": plan.dtype or "keep",
        "groups": plan.groups,
        "aliases": plan.aliases,
        **({"quantization": {k: v for k, v in plan.quantization.items() if k != "config"}} if plan.quantization else {}),
        **(extra or {}),
    }
    # the manifest and card travel with the model: they name its sources publicly, this machine's ledger keeps
    # the full paths for `verify` (storage/ledger.py)
    manifest["source"], private = split_private(manifest["source"])
    stored = stored or {}
    (folder / CARD_FILE).write_text(model_card(manifest, config, manifest.get("verification", [])))
    files = sorted({*plan.files, *descriptive, CARD_FILE})
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
