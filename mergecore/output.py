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

import torch

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
    floating = [t.dtype for t in plan.tensors if getattr(torch, t.dtype).is_floating_point]
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


def write_metadata(source: CheckpointSource, config: dict, plan: MergePlan, folder: Path, extra: dict | None = None) -> dict:
    """Index, config.json, copied files and the manifest (sha256 of every file) into `folder`."""
    (folder / INDEX_FILE).write_text(json.dumps(plan.index(), indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(output_config(config, plan), indent=2) + "\n")
    copy_hf_files(source, folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    with ThreadPoolExecutor(2) as pool:
        digests = dict(zip(files, pool.map(lambda name: sha256_file(folder / name), files)))
    manifest = {
        "ckptflow_version": ckptflow_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source.describe(),
        "dtype": plan.dtype or "keep",
        "groups": plan.groups,
        "aliases": plan.aliases,
        "files": {name: {"sha256": digests[name], "size": (folder / name).stat().st_size} for name in files},
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
