"""Finish a merged folder: index, config, tokenizer and friends, manifest; then publish by rename."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from .arrays import FLOATING
from .formats import CheckpointSource
from .plan import INDEX_FILE, MergePlan

MANIFEST_FILE = "ckptflow_manifest.json"
# Weight files in huggingface/ describe the base model, not the trained one: never copied.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")


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
    return config


def copy_hf_files(source: CheckpointSource, folder: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template, custom code... verbatim from huggingface/."""
    copied = []
    hf_dir = source.hf_dir
    for name in hf_dir.listdir():
        entry = hf_dir.join(name)
        if name == "config.json" or name.endswith(_NOT_COPIED) or entry.isdir():
            continue
        with entry.open("rb") as src, open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
        copied.append(name)
    return copied


class BackgroundHashes:
    """sha256 of finished files, computed on one background thread while other work goes on.

    >>> hashes = BackgroundHashes(folder); hashes.start(["model-00001-of-00002.safetensors"])  # doctest: +SKIP
    >>> hashes.digests()                                                                  # doctest: +SKIP
    """

    def __init__(self, folder: Path):
        self._folder = folder
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._futures: dict = {}

    def start(self, names: list[str]) -> None:
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._pool.submit(sha256_file, self._folder / name)

    def start_written(self, plan: MergePlan, written_groups: set[str]) -> None:
        """Start on every file whose groups are all written (groups may finish in any order)."""
        self.start([file for file in plan.files if file not in self._futures
                    and {t.group for t in plan.in_file(file)} <= written_groups])

    def digests(self) -> dict[str, str]:
        try:
            return {name: future.result() for name, future in self._futures.items()}
        finally:
            self._pool.shutdown()


def write_metadata(source: CheckpointSource, config: dict, plan: MergePlan, folder: Path, extra: dict | None = None,
                   known: dict[str, str] | None = None) -> dict:
    """Index, config.json, copied files and the manifest (sha256 of every file) into `folder`.

    `known` holds sha256 digests already computed (the weight files, hashed while verifying).
    """
    (folder / INDEX_FILE).write_text(json.dumps(plan.index(), indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(output_config(config, plan), indent=2) + "\n")
    copy_hf_files(source, folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    digests = dict(known or {})
    digests.update({name: sha256_file(folder / name) for name in files if name not in digests})
    manifest = {
        "ckptflow_version": ckptflow_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source.describe(),
        "dtype": plan.dtype or "keep",
        "groups": plan.groups,
        "aliases": plan.aliases,
        "files": {name: {"sha256": digests[name], "size": (folder / name).stat().st_size,
                         "mtime_ns": (folder / name).stat().st_mtime_ns} for name in files},
        **(extra or {}),
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def publish(staging: Path, target: Path, overwrite: bool) -> Path:
    """Move the finished staging folder to `target` by rename; an old target is swapped out first."""
    target = target.absolute()
    if target.exists():
        if not overwrite and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} exists")
        retired = target.parent / f".{target.name}.ckptflow-old-{uuid.uuid4().hex[:8]}"
        os.rename(target, retired)
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, target)
    return target
