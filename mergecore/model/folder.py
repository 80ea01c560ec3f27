"""What a merged folder holds beside its weights and manifest: config.json, the index, the files copied from the
checkpoint's huggingface/ (tokenizer, generation config, chat template, custom code), and nothing else.

>>> write_descriptive_files(source, config, index, Path("out/.model.ckptflow-partial"))  # doctest: +SKIP
['model.safetensors.index.json', 'config.json', 'generation_config.json', 'tokenizer.json']
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ..formats import CheckpointSource
from ..storage import checked_publishable, link_root, publishable_hf_files
from .card import CARD_FILE

INDEX_FILE = "model.safetensors.index.json"
STAGING_MARKER = ".ckptflow-staging"  # in a staging folder ckptflow made (targets/local.py); never published
PARTIAL_SUFFIX = ".ckptflow-partial"  # staging folder of target T: .T.ckptflow-partial beside it
# Weight files in huggingface/ describe the base model, not the trained one: never copied. Nor is its model
# card: the folder gets its own (card.py), nor its config (rewritten) or a manifest.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")
_NOT_COPIED_NAMES = ("config.json", CARD_FILE, "ckptflow_manifest.json")


# The names ckptflow keeps beside or inside a target for itself (`.NAME.ckptflow-partial`, `-lock`, `-results`,
# `-retired-*`, `.ckptflow-staging`): never a target, or a merge would write into its own staging or results.
_OWN_NAME = re.compile(r"\.(?:.+\.)?ckptflow-[a-z]+(?:-.*)?")


def own_name_in(path: str) -> str | None:
    """The first part of `path` (a folder or URL) that names one of ckptflow's own folders or files, else None.

    >>> own_name_in("/models/.run1.ckptflow-partial/x"), own_name_in("s3://m/run1")
    ('.run1.ckptflow-partial', None)
    """
    return next((part for part in re.split(r"[/\\]+", path) if _OWN_NAME.fullmatch(part)), None)


def copy_hf_files(source: CheckpointSource, folder: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template, custom code... from huggingface/: its regular files
    inside the checkpoint (`storage.publishable_hf_files`, checked again here as each is opened), as new files with
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
    its publishable files (`storage.publishable_hf_files`) but the base model's weights, config.json (rewritten:
    `output_config`), its model card and any manifest.

    >>> copied_names(open_checkpoint("ckpts/run1"))  # doctest: +SKIP
    ['generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
    """
    if source.hf_dir is None:
        return []
    return [name for name in publishable_hf_files(source.hf_dir, source.location)
            if name not in _NOT_COPIED_NAMES and not name.endswith(_NOT_COPIED)]


def clear_strays(folder: Path, keep: set[str]) -> None:
    """Remove every entry of `folder` not named in `keep`: a staging folder publishes exactly what was planned
    (leftovers of a killed run with another shard size, files someone put there)."""
    for entry in folder.iterdir():
        if entry.name not in keep and entry.name != STAGING_MARKER:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def write_descriptive_files(source: CheckpointSource, config: dict, index: dict, folder: Path) -> list[str]:
    """The index, config.json (as the merge declares it: `engine.plan.output_config`) and the files copied from
    huggingface/ into `folder`; returns their names."""
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [INDEX_FILE, "config.json", *copy_hf_files(source, folder)]
