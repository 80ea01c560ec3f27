"""Range reads: a remote rank file (FSDP's, Megatron's `model.pt` and `.distcp`) read by byte range into a sparse
local file (`RangeFile`), only the ranges a merge needs downloaded, batched across files (`fetch_ranges`).

Ranges closer than `range_gap()` are joined into one request unless a fenced span (what must never be read, such as
optimizer state in the same archive) lies between them; requests are cut at RANGE_CHUNK bytes and sent together in
batches of at most RANGE_BATCH_COUNT requests and RANGE_BATCH_BYTES bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import tempfile
import threading
import weakref
from pathlib import Path

import fsspec

from .locations import Location, RemoteReadError, default_cache_dir, fingerprint_of

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
        self.location, self.identity = location, fingerprint_of(info)
        self.size = int(info["size"])
        folder = Path(cache_dir) if cache_dir else default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        self._fd, name = tempfile.mkstemp(dir=folder, prefix=f"{location.url_key()}-ranges-")
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
        info = location.retried("stat", location.fresh_info)
        with cls._registry_lock:
            known = cls._open.get(location.url)
            if known is None or known.identity != fingerprint_of(info):
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
                paths = [remote.location.fs_path[1] for remote, _, _ in batch]
                blobs = location.retried("read", lambda: _cat_ranges(fs, paths, batch))
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
