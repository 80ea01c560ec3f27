"""Locations: a file or folder behind any fsspec URL (or a plain local path), read through one small `Location` type.

Local files are used in place (so they can be mmapped). Remote files read whole (`.metadata`, `common.pt`,
huggingface/ files) are copied into a local cache folder and mmapped from there: disk, not RAM, holds them. A copy
is named after the URL *and* the file's fingerprint (size + etag/mtime, `fingerprint_of`), so a file rewritten at
the same URL is fetched again and never read stale; copies are downloaded under a temporary name, checked for size
and renamed into place, so an interrupted download is never trusted. (Rank files are read by byte range instead:
`storage/ranges.py`.)

Remote reads are retried on transient errors (network, throttling: OSError subclasses other than
"not found" / "permission denied"), `CKPTFLOW_READ_RETRIES` times (default 3) with exponential backoff
from `CKPTFLOW_READ_BACKOFF` seconds (default 0.5); then `RemoteReadError`, one line naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError
from .retries import Retries

T = TypeVar("T")

# Errors that retrying cannot fix: the file is not there, or we may not read it.
PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
FINGERPRINT_FIELDS = ("size", "mtime", "ETag", "etag", "LastModified", "last_modified", "checksum", "md5")
PARTIAL_MARK = ".partial-"


class RemoteReadError(CheckpointError, OSError):
    """A remote read still failing after the retry budget.

    A CheckpointError, so the CLI prints its one line and exits 2; an OSError too, so the pipeline's
    merge task (which retries OSError) tries the group again later.
    """


def default_cache_dir() -> Path:
    return Path(os.environ.get("CKPTFLOW_CACHE", "~/.cache/ckptflow")).expanduser()


def fingerprint_of(info: dict) -> dict:
    """What identifies a file's content cheaply, from its fsspec `info`: size plus mtime, etag or checksum.

    >>> fingerprint_of({"name": "x", "size": 3, "ETag": '"ab"', "type": "file"})
    {'size': '3', 'ETag': '"ab"'}
    """
    return {k: str(info[k]) for k in FINGERPRINT_FIELDS if k in info}


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
    def fs_path(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(the fsspec filesystem, the path on it) of this URL."""
        return fsspec.core.url_to_fs(self.url)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.fs_path[0]

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

    def url_key(self) -> str:
        """A short key of this URL for local file names (cached copies, range files, a remote target's state).

        >>> Location.of("s3://b/run").url_key() == Location.of("s3://b/run/").url_key()
        True
        """
        return hashlib.sha256(self.url.encode()).hexdigest()[:20]

    def exists(self) -> bool:
        fs, path = self.fs_path
        return self._reading(fs, "check", lambda: fs.exists(path))

    def isdir(self) -> bool:
        fs, path = self.fs_path
        return self._reading(fs, "check", lambda: fs.isdir(path))

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries in this folder, sorted (listed afresh, never from a listing cache)."""
        fs, path = self.fs_path

        def listed() -> list[str]:
            fs.invalidate_cache(path)  # s3fs & co. keep listings: a rewritten file would keep its old etag
            if not fs.isdir(path):
                return []
            return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))

        return self._reading(fs, "list", listed)

    def open(self, mode: str = "rb"):
        """A file object; remote files are read from their verified local copy (see `local_file`)."""
        fs, path = self.fs_path
        if mode == "rb" and not isinstance(fs, LocalFileSystem):
            return open(self.local_file(), "rb")
        return fs.open(path, mode)

    def read_bytes(self) -> bytes:
        """The file's bytes. A local path must lead to a regular file: a FIFO would block forever and a device
        (`/dev/zero`) never end, so both are refused in one line."""
        fs, path = self.fs_path
        if isinstance(fs, LocalFileSystem):
            with open_regular(path, follow=True) as f:
                return f.read()
        return self._reading(fs, "read", lambda: fs.cat_file(path))

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def info(self) -> dict:
        fs, path = self.fs_path
        return self._reading(fs, "stat", lambda: fs.info(path))

    def fresh_info(self) -> dict:
        """This file's info asked of the store now (its listing cache dropped first), not retried."""
        fs, path = self.fs_path
        return self._fresh_info(fs, path)

    def fingerprint(self) -> dict:
        """What identifies this file's content cheaply: size plus mtime, etag or checksum."""
        return fingerprint_of(self.info())

    def local_file(self, cache_dir: str | os.PathLike | None = None) -> str:
        """A path on local disk with this file's current bytes (remote files: a verified cached copy).

        >>> Location.of("/tmp/x.pt").local_file()
        '/tmp/x.pt'
        """
        fs, path = self.fs_path
        if isinstance(fs, LocalFileSystem):
            return path
        folder = Path(cache_dir) if cache_dir else default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        return self._reading(fs, "download", lambda: self._cached_copy(fs, path, folder))

    def retried(self, doing: str, call: Callable[[], T]) -> T:
        """`call()` (a read of this location: `doing` names it in the error), retried on transient errors when this
        location is remote; a read still failing after the budget is a one-line `RemoteReadError`."""
        return self._reading(self.fs, doing, call)

    # ---- remote copies ------------------------------------------------------------------------

    def _cached_copy(self, fs: fsspec.AbstractFileSystem, path: str, folder: Path) -> str:
        info = self._fresh_info(fs, path)
        copy = folder / self._copy_name(fingerprint_of(info))
        size = info.get("size")
        if copy.is_file() and (size is None or copy.stat().st_size == size):
            return str(copy)
        handle, partial = tempfile.mkstemp(dir=folder, prefix=copy.name + PARTIAL_MARK)
        os.close(handle)
        try:
            fs.get_file(path, partial)
            got = os.path.getsize(partial)
            if size is not None and got != size:
                raise OSError(f"download stopped at {got} of {size} bytes")
            if fingerprint_of(self._fresh_info(fs, path)) != fingerprint_of(info):
                raise OSError("the file changed while it was being copied")
            os.replace(partial, copy)
        finally:
            Path(partial).unlink(missing_ok=True)
        self._drop_older_copies(folder, copy)
        return str(copy)

    def _copy_name(self, identity: dict) -> str:
        content_key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        return f"{self.url_key()}-{content_key}-{self.name}"

    def _drop_older_copies(self, folder: Path, current: Path) -> None:
        # Copies of earlier versions of this URL; unlinking is safe even while another reader maps one.
        for old in folder.glob(f"{self.url_key()}-*"):
            if old != current and PARTIAL_MARK not in old.name:
                old.unlink(missing_ok=True)

    @staticmethod
    def _fresh_info(fs: fsspec.AbstractFileSystem, path: str) -> dict:
        fs.invalidate_cache(path)
        return fs.info(path)

    # ---- retries ------------------------------------------------------------------------------

    def _reading(self, fs: fsspec.AbstractFileSystem, doing: str, call: Callable[[], T]) -> T:
        """`retried` with the filesystem its caller already holds (no second URL parse on local reads)."""
        if isinstance(fs, LocalFileSystem):
            return call()
        policy = Retries.from_env("CKPTFLOW_READ", 3, 0.5)

        def transient(error: Exception, attempt: int) -> float | None:
            permanent = isinstance(error, (CheckpointError, *PERMANENT_ERRORS)) or not isinstance(error, OSError)
            return None if permanent else policy.delay(attempt)

        try:
            return policy.call(call, transient)
        except OSError as failure:
            if transient(failure, 0) is None:
                raise
            raise RemoteReadError(
                f"{self.url}: {doing} failed {policy.retries + 1} times ({_one_line(failure)}); check the storage "
                "service and network and run again (more patience: CKPTFLOW_READ_RETRIES, CKPTFLOW_READ_BACKOFF)"
            ) from None

    def __str__(self) -> str:
        return self.url


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- local files opened as regular files only (Location.read_bytes, and what storage/publishable.py lets out) ----


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, as an error names it ("a FIFO", "a link", ...).

    >>> file_kind(os.stat("/dev/null").st_mode)
    'a character device'
    """
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a folder", stat.S_ISLNK: "a link"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, follow: bool = False):
    """A local regular file opened for reading, never blocking: opened with O_NONBLOCK (a FIFO opens at once
    instead of waiting for a writer) and O_NOFOLLOW unless `follow`, then checked with fstat; anything but a
    regular file is a one-line CheckpointError.

    >>> open_regular("/dev/zero", follow=True)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: /dev/zero: a character device, not a regular file; ...
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise CheckpointError(f"{path}: a link, not a regular file; replace it with the file itself") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path}: {file_kind(mode)}, not a regular file; replace it with the file itself")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
