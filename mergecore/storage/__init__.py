"""Where checkpoints live: any fsspec URL, read through one small `Location` type.

Long (~560 lines) because local and remote reading share one `Location` type: ranged reads, verified cached
copies, retries and the checks of which files may leave a checkpoint folder sit together.

Local files are used in place (so they can be mmapped). Remote rank files (FSDP's, Megatron's `model.pt`
and `.distcp`) are read by byte range (`RangeFile`): only the ranges a merge needs are downloaded, into a
sparse local file that is mmapped like a local one. Other remote files (`.metadata`, `common.pt`,
huggingface/ files) are copied whole into a local cache folder and mmapped from there: disk, not RAM, holds them. A copy is named after the URL *and* the
file's fingerprint (size + etag/mtime), so a file rewritten at the same URL is fetched again and
never read stale; copies are downloaded under a temporary name, checked for size and renamed into
place, so an interrupted download is never trusted.

Remote reads are retried on transient errors (network, throttling: OSError subclasses other than
"not found" / "permission denied"), `CKPTFLOW_READ_RETRIES` times (default 3) with exponential backoff
from `CKPTFLOW_READ_BACKOFF` seconds (default 0.5); then `RemoteReadError`, one line naming the file.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import json
import os
import posixpath
import stat
import tempfile
import threading
import weakref
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
        return self._reading(fs, "check", lambda: fs.exists(path))

    def isdir(self) -> bool:
        fs, path = self._fs_path
        return self._reading(fs, "check", lambda: fs.isdir(path))

    def listdir(self) -> list[str]:
        """Names (not paths) of the entries in this folder, sorted (listed afresh, never from a listing cache)."""
        fs, path = self._fs_path

        def listed() -> list[str]:
            fs.invalidate_cache(path)  # s3fs & co. keep listings: a rewritten file would keep its old etag
            if not fs.isdir(path):
                return []
            return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))

        return self._reading(fs, "list", listed)

    def open(self, mode: str = "rb"):
        """A file object; remote files are read from their verified local copy (see `local_file`)."""
        fs, path = self._fs_path
        if mode == "rb" and not isinstance(fs, LocalFileSystem):
            return open(self.local_file(), "rb")
        return fs.open(path, mode)

    def read_bytes(self) -> bytes:
        """The file's bytes. A local path must lead to a regular file: a FIFO would block forever and a device
        (`/dev/zero`) never end, so both are refused in one line."""
        fs, path = self._fs_path
        if isinstance(fs, LocalFileSystem):
            with open_regular(path, follow=True) as f:
                return f.read()
        return self._reading(fs, "read", lambda: fs.cat_file(path))

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def info(self) -> dict:
        fs, path = self._fs_path
        return self._reading(fs, "stat", lambda: fs.info(path))

    def fingerprint(self) -> dict:
        """What identifies this file's content cheaply: size plus mtime, etag or checksum."""
        return _identity(self.info())

    def local_file(self, cache_dir: str | os.PathLike | None = None) -> str:
        """A path on local disk with this file's current bytes (remote files: a verified cached copy).

        >>> Location.of("/tmp/x.pt").local_file()
        '/tmp/x.pt'
        """
        fs, path = self._fs_path
        if isinstance(fs, LocalFileSystem):
            return path
        folder = Path(cache_dir) if cache_dir else default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        return self._reading(fs, "download", lambda: self._cached_copy(fs, path, folder))

    # ---- remote copies ------------------------------------------------------------------------

    def _cached_copy(self, fs: fsspec.AbstractFileSystem, path: str, folder: Path) -> str:
        info = self._fresh_info(fs, path)
        copy = folder / self._copy_name(_identity(info))
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
            if _identity(self._fresh_info(fs, path)) != _identity(info):
                raise OSError("the file changed while it was being copied")
            os.replace(partial, copy)
        finally:
            Path(partial).unlink(missing_ok=True)
        self._drop_older_copies(folder, copy)
        return str(copy)

    def _url_key(self) -> str:
        return hashlib.sha256(self.url.encode()).hexdigest()[:20]

    def _copy_name(self, identity: dict) -> str:
        content_key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        return f"{self._url_key()}-{content_key}-{self.name}"

    def _drop_older_copies(self, folder: Path, current: Path) -> None:
        # Copies of earlier versions of this URL; unlinking is safe even while another reader maps one.
        for old in folder.glob(f"{self._url_key()}-*"):
            if old != current and PARTIAL_MARK not in old.name:
                old.unlink(missing_ok=True)

    @staticmethod
    def _fresh_info(fs: fsspec.AbstractFileSystem, path: str) -> dict:
        fs.invalidate_cache(path)
        return fs.info(path)

    # ---- retries ------------------------------------------------------------------------------

    def _reading(self, fs: fsspec.AbstractFileSystem, doing: str, call: Callable[[], T]) -> T:
        """`call()`, retried on transient errors when this location is remote."""
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


# ---- files that may be published: regular files inside the checkpoint ---------------------------


def _kind(mode: int) -> str:
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
        raise CheckpointError(f"{path}: {_kind(mode)}, not a regular file; replace it with the file itself")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


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


def publishable_files(hf_dir: Location | None, checkpoint: Location) -> list[str]:
    """Names of the files of `hf_dir` (a checkpoint's huggingface/ folder) that a merge may copy into its output:
    regular files, or links that resolve to one inside the checkpoint (`link_root`). Sub-folders are skipped (never
    copied). Anything else (a link out of the checkpoint or to a folder, a FIFO, a device, a socket, a name that is
    not UTF-8) is a one-line CheckpointError naming it: a checkpoint folder is untrusted input and its
    huggingface/ files are published without a human look. A folder that does not exist lists nothing.

    Remote folders (fsspec) list their entries of type "file"; other types (links, special files of a local
    fsspec filesystem) are refused, directories skipped.

    >>> publishable_files(Location.of("ckpt/actor/huggingface"), Location.of("ckpt/actor"))  # doctest: +SKIP
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
            raise CheckpointError(f"{path}: {_kind(mode)}, not a regular file; remove it from the checkpoint's "
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
    """An open file for one entry `publishable_files` let through, read as a regular file inside `root`
    (re-checked at open: the folder may have changed since it was listed)."""
    if not location.is_local:
        return location.open("rb")
    resolved, top = os.path.realpath(location.url), os.path.realpath(root.url)
    if os.path.commonpath([resolved, top]) != top:
        raise CheckpointError(f"{location}: a link to {resolved}, outside the checkpoint folder {top}; replace it "
                              "with the file itself or remove it (nothing outside the checkpoint is published)")
    return open_regular(resolved)


def _remote_publishable(hf_dir: Location) -> list[str]:
    fs, path = hf_dir._fs_path

    def listed() -> list[dict]:
        fs.invalidate_cache(path)
        return fs.ls(path, detail=True) if fs.isdir(path) else []

    names = []
    for entry in sorted(hf_dir._reading(fs, "list", listed), key=lambda e: e["name"]):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry.get("type") == "directory":
            continue
        if entry.get("type") != "file" or entry.get("islink"):
            raise CheckpointError(f"{hf_dir.join(name)}: {entry.get('type')!r} entry, not a regular file; remove it "
                                  "from the checkpoint's huggingface/ folder (only regular files are published)")
        names.append(name)
    return names


def _identity(info: dict) -> dict:
    return {k: str(info[k]) for k in FINGERPRINT_FIELDS if k in info}


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- range reads -------------------------------------------------------------------------------

RANGE_CHUNK = 16 << 20      # largest single range request
RANGE_BATCH_BYTES = 128 << 20  # requests sent together (s3fs runs them concurrently) hold at most this...
RANGE_BATCH_COUNT = 256     # ...and are at most this many


def range_gap() -> int:
    """Ranges closer than this many bytes are fetched as one request (`CKPTFLOW_RANGE_GAP`, default 64 KiB):
    fewer round trips for a few bytes more."""
    return int(os.environ.get("CKPTFLOW_RANGE_GAP", 64 << 10))


class RangeFile:
    """A remote file read by byte ranges, on demand, into a sparse local file of the same size.

    Only the ranges asked for (`fetch`) are downloaded, each once per process; the sparse file
    can be mmapped like a local file (`path`), so readers keep their numpy views. It lives in the
    cache folder but is unlinked at once: no other process ever sees it, so a half-written range
    can never be trusted later, and nothing is left behind; its space is freed when the last
    reader (a checkpoint object and its mapped arrays) is gone. Memory holds one batch of
    requests (RANGE_BATCH_BYTES); the rest is page cache over the sparse file.

    One per URL *and* fingerprint (`RangeFile.of`): a file rewritten at the same URL gets a new one,
    so stale bytes are never read.

    >>> rank = RangeFile.of(Location.of("s3://ckpts/run/actor/model_world_size_2_rank_0.pt"))  # doctest: +SKIP
    >>> rank.fetch([(0, 4096)]); open(rank.path, "rb").read(4)                                   # doctest: +SKIP
    b'PK\\x03\\x04'
    """

    # Weak: a range file (and its disk space) lasts as long as a checkpoint reading it, not the process.
    _open: weakref.WeakValueDictionary[str, RangeFile] = weakref.WeakValueDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, location: Location, info: dict, cache_dir: str | os.PathLike | None = None):
        self.location, self.identity = location, _identity(info)
        self.size = int(info["size"])
        folder = Path(cache_dir) if cache_dir else default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        self._fd, name = tempfile.mkstemp(dir=folder, prefix=f"{location._url_key()}-ranges-")
        os.unlink(name)
        os.ftruncate(self._fd, self.size)
        self._present: list[tuple[int, int]] = []  # sorted, disjoint [start, end) already written
        self._fenced: list[tuple[int, int]] = []  # sorted spans a joined request must never reach into
        # Held while this file is fetched into: a thread needing bytes another thread is fetching waits for them.
        self.lock = threading.Lock()
        self.fetched_bytes = 0

    @classmethod
    def of(cls, location: Location, cache_dir: str | os.PathLike | None = None) -> RangeFile:
        """The range file of `location`'s current version (its fingerprint is read afresh)."""
        fs, path = location._fs_path
        info = location._reading(fs, "stat", lambda: Location._fresh_info(fs, path))
        with cls._registry_lock:
            known = cls._open.get(location.url)
            if known is None or known.identity != _identity(info):
                known = cls._open[location.url] = RangeFile(location, info, cache_dir)  # an older one closes when unused
            return known

    @property
    def path(self) -> str:
        """A path that opens the sparse file (through this process's descriptor)."""
        return f"/proc/self/fd/{self._fd}"

    def missing(self, ranges) -> list[tuple[int, int]]:
        """The parts of `ranges` not fetched yet."""
        gaps = []
        for start, end in sorted(ranges):
            for have_start, have_end in self._present:
                if have_end <= start or have_start >= end:
                    continue
                if have_start > start:
                    gaps.append((start, have_start))
                start = max(start, have_end)
            if start < end:
                gaps.append((start, end))
        return gaps

    def keep_out(self, spans) -> None:
        """Never fetch bytes of `spans` by joining neighbouring ranges across them: they hold what must not
        be read (optimizer state sharing an archive with the model). Asking for them directly still works.

        >>> rank.keep_out([(4096, 8192)]); rank.fetch([(0, 100), (9000, 9100)])  # two requests  # doctest: +SKIP
        200
        """
        self._fenced = _merged(self._fenced + [(s, e) for s, e in spans if e > s])

    def fetch(self, ranges, join_gap: int | None = None) -> int:
        """Make the bytes of `ranges` ([start, end) pairs) present in the sparse file; returns bytes downloaded.

        Ranges closer than `join_gap` bytes (default `range_gap()`) are fetched as one request."""
        return fetch_ranges({self: ranges}, join_gap)

    def _write(self, start: int, blob: bytes, end: int) -> None:
        if len(blob) != end - start:
            raise RemoteReadError(f"{self.location}: asked for bytes {start}-{end}, got {len(blob)}; the file "
                                  "changed while it was read: run again")
        os.pwrite(self._fd, blob, start)
        self._present = _merged(self._present + [(start, end)])
        self.fetched_bytes += len(blob)

    def __del__(self):
        try:
            os.close(self._fd)
        except (OSError, AttributeError):
            pass


def fetch_ranges(wanted: dict[RangeFile, list[tuple[int, int]]], join_gap: int | None = None) -> int:
    """Fetch ranges of several remote files at once: the missing ones, joined when closer than `join_gap`
    (default `range_gap()`), sent as concurrent batches across files (`fs.cat_ranges`). Returns bytes downloaded.

    >>> fetch_ranges({rank0: [(0, 1024)], rank1: [(4096, 8192)]})  # doctest: +SKIP
    5120
    """
    gap = range_gap() if join_gap is None else join_gap
    with contextlib.ExitStack() as held:
        for remote in sorted(wanted, key=lambda r: (r.location.url, id(r))):  # one order: no deadlock
            held.enter_context(remote.lock)
        jobs = [(remote, start, end) for remote, ranges in wanted.items()
                for start, end in _requests(remote.missing([(max(0, s), min(remote.size, e)) for s, e in ranges if e > s]),
                                            gap, remote._fenced)]
        by_fs: dict[int, list] = {}
        for job in jobs:
            by_fs.setdefault(id(job[0].location.fs), []).append(job)
        for same_fs in by_fs.values():
            for batch in _batches(same_fs):
                location = batch[0][0].location
                fs = location.fs
                paths = [remote.location._fs_path[1] for remote, _, _ in batch]
                blobs = location._reading(fs, "read", lambda: _cat_ranges(fs, paths, batch))
                for (remote, start, end), blob in zip(batch, blobs):
                    remote._write(start, blob, end)
        return sum(end - start for _, start, end in jobs)


def _batches(jobs: list):
    """`(file, start, end)` jobs in batches of at most RANGE_BATCH_COUNT requests and RANGE_BATCH_BYTES bytes."""
    batch, size = [], 0
    for job in jobs:
        length = job[2] - job[1]
        if batch and (len(batch) == RANGE_BATCH_COUNT or size + length > RANGE_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(job)
        size += length
    if batch:
        yield batch


def _requests(gaps: list[tuple[int, int]], join_gap: int, fenced: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """`gaps` joined when closer than `join_gap` (and no `fenced` span lies between them), cut into requests
    of at most RANGE_CHUNK bytes."""
    fence_starts = [start for start, _ in fenced]
    joined: list[list[int]] = []
    for start, end in gaps:
        if joined and start - joined[-1][1] <= join_gap and end - joined[-1][0] <= RANGE_CHUNK \
                and not _crosses(fenced, fence_starts, joined[-1][1], start):
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([start, end])
    requests = []
    for start, end in joined:
        requests += [(s, min(end, s + RANGE_CHUNK)) for s in range(start, end, RANGE_CHUNK)]
    return requests


def _crosses(fenced: list[tuple[int, int]], starts: list[int], low: int, high: int) -> bool:
    """Whether a fenced span overlaps [low, high) (`fenced` sorted and disjoint, `starts` their starts)."""
    at = bisect.bisect_left(starts, high) - 1  # the last span starting before `high`
    return at >= 0 and fenced[at][1] > low


def _cat_ranges(fs: fsspec.AbstractFileSystem, paths: list[str], batch: list) -> list[bytes]:
    blobs = fs.cat_ranges(paths, [start for _, start, _ in batch], [end for _, _, end in batch], on_error="raise")
    for blob in blobs:
        if isinstance(blob, BaseException):
            raise blob
    return blobs


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
