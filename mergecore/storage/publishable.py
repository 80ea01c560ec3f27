"""Which files of a checkpoint's huggingface/ folder may be published, and opening them link-safely.

A checkpoint folder is untrusted input and its huggingface/ files (tokenizer, generation config, custom code) are
published without a human look: only regular files, or links that resolve to one inside the checkpoint, ever
leave it. They are listed once before anything is written (`publishable_hf_files`) and checked again as each is
opened (`checked_publishable`): the folder may change between the two.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from ..errors import CheckpointError
from .locations import Location, file_kind, open_regular


def link_root(hf_dir: Location, checkpoint: Location) -> Location:
    """The folder a link in `hf_dir` may point into: the checkpoint folder when `hf_dir` lies in it (its
    huggingface/ folder); the repo folder of a Hugging Face cache snapshot (`models--org--name/snapshots/REV`,
    whose files are links into `../../blobs/`); else `hf_dir` itself (a folder given with --hf_model_path)."""
    inside = hf_dir.url == checkpoint.url or hf_dir.url.startswith(checkpoint.url.rstrip("/") + "/")
    if inside:
        return checkpoint
    if hf_dir.parent.name == "snapshots" and hf_dir.parent.parent.name.startswith("models--"):
        return hf_dir.parent.parent
    return hf_dir


def publishable_hf_files(hf_dir: Location | None, checkpoint: Location) -> list[str]:
    """Names of the files of `hf_dir` (a checkpoint's huggingface/ folder) that a merge may copy into its output:
    regular files, or links that resolve to one inside the checkpoint (`link_root`). Sub-folders are skipped (never
    copied). Anything else (a link out of the checkpoint or to a folder, a FIFO, a device, a socket, a name that is
    not UTF-8) is a one-line CheckpointError naming it: a checkpoint folder is untrusted input and its
    huggingface/ files are published without a human look. A folder that does not exist lists nothing.

    Remote folders (fsspec) list their entries of type "file"; other types (links, special files of a local
    fsspec filesystem) are refused, directories skipped.

    >>> publishable_hf_files(Location.of("ckpt/actor/huggingface"), Location.of("ckpt/actor"))  # doctest: +SKIP
    ['config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json']
    """
    if hf_dir is None:
        return []
    if not hf_dir.is_local:
        return _remote_publishable(hf_dir)
    folder = Path(hf_dir.url)
    if not folder.is_dir():
        return []
    root = os.path.realpath(link_root(hf_dir, checkpoint).url)
    names = []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(f"{folder}/{ascii(name)[1:-1]}: a file name that is not UTF-8; rename or remove "
                                  "it (a Hugging Face folder's names are UTF-8)") from None
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            continue
        if stat.S_ISLNK(mode):
            mode = _link_target_mode(path, root)
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: {file_kind(mode)}, not a regular file; remove it from the checkpoint's "
                                  "huggingface/ folder (only regular files are published)")
        names.append(name)
    return names


def _link_target_mode(path: Path, root: str) -> int:
    """The mode of what the link `path` resolves to, which must lie inside `root`."""
    resolved = os.path.realpath(path)
    if os.path.commonpath([resolved, root]) != root:
        raise CheckpointError(f"{path}: a link to {resolved}, outside the checkpoint folder {root}; replace it with "
                              "the file itself or remove it (nothing outside the checkpoint is published)")
    try:
        mode = os.stat(resolved).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: a link to {resolved}, which does not exist; remove it") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: a link to the folder {resolved}; remove it (sub-folders are not published)")
    return mode


def checked_publishable(location: Location, root: Location):
    """An open file for one entry `publishable_hf_files` let through, read as a regular file inside `root`
    (re-checked at open: the folder may have changed since it was listed)."""
    if not location.is_local:
        return location.open("rb")
    resolved, top = os.path.realpath(location.url), os.path.realpath(root.url)
    if os.path.commonpath([resolved, top]) != top:
        raise CheckpointError(f"{location}: a link to {resolved}, outside the checkpoint folder {top}; replace it "
                              "with the file itself or remove it (nothing outside the checkpoint is published)")
    return open_regular(resolved)


def _remote_publishable(hf_dir: Location) -> list[str]:
    fs, path = hf_dir.fs_path

    def listed() -> list[dict]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True) if fs.isdir(path) else []

    names = []
    for entry in sorted(hf_dir.retried("list", listed), key=lambda e: e["name"]):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry.get("type") == "directory":
            continue
        if entry.get("type") != "file" or entry.get("islink"):
            raise CheckpointError(f"{hf_dir.join(name)}: {entry.get('type')!r} entry, not a regular file; remove it "
                                  "from the checkpoint's huggingface/ folder (only regular files are published)")
        names.append(name)
    return names
