"""Where checkpoints live: any fsspec URL, read through one small `Location` type.

Local files are used in place (so torch can mmap them). Remote files are copied once into a
local cache folder and mmapped from there: disk, not RAM, holds them.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem


@dataclass(frozen=True)
class Location:
    """A file or folder behind an fsspec URL (or a plain local path).

    >>> Location.of("/tmp").join("x.json").url
    '/tmp/x.json'
    """

    url: str

    @staticmethod
    def of(url: str | os.PathLike | Location) -> Location:
        if isinstance(url, Location):
            return url
        text = os.fspath(url)
        if "://" not in text and "::" not in text:
            text = str(Path(text).expanduser().absolute())
        return Location(text.rstrip("/") or "/")

    @property
    def _fs_path(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return fsspec.core.url_to_fs(self.url)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._fs_path[0]

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url.rstrip("/"))

    @property
    def parent(self) -> Location:
        return Location(posixpath.dirname(self.url.rstrip("/")))

    def join(self, *parts: str) -> Location:
        return Location(posixpath.join(self.url, *parts))

    def exists(self) -> bool:
        fs, path = self._fs_path
        return fs.exists(path)

    def isdir(self) -> bool:
        fs, path = self._fs_path
        return fs.isdir(path)

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries in this folder, sorted."""
        fs, path = self._fs_path
        if not fs.isdir(path):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))

    def open(self, mode: str = "rb"):
        fs, path = self._fs_path
        return fs.open(path, mode)

    def read_text(self) -> str:
        with self.open("rb") as f:
            return f.read().decode("utf-8")

    def info(self) -> dict:
        fs, path = self._fs_path
        return fs.info(path)

    def fingerprint(self) -> dict:
        """What identifies this file's content cheaply: size plus mtime, etag or checksum."""
        info = self.info()
        keep = ("size", "mtime", "ETag", "etag", "LastModified", "last_modified", "checksum", "md5")
        return {k: str(info[k]) for k in keep if k in info}

    def local_file(self, cache_dir: str | os.PathLike | None = None) -> str:
        """A path on local disk with this file's bytes (remote files are cached once)."""
        fs, path = self._fs_path
        if isinstance(fs, LocalFileSystem):
            return path
        cache = os.fspath(cache_dir or Path(os.environ.get("CKPTFLOW_CACHE", "~/.cache/ckptflow")).expanduser())
        return fsspec.open_local(f"filecache::{self.url}", filecache={"cache_storage": cache})

    def __str__(self) -> str:
        return self.url
