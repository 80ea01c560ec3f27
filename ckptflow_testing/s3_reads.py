"""Bytes s3fs returned in this process, per object key, counted at s3fs's boundary (`_cat_file` for ranged and
small GETs, `_get_file` for whole downloads): what tests and benches use to see who read what, never
ckptflow's own counters. In the processes of a Dask cluster: `client.run(count_s3_reads)`, work, then
`client.run(s3_reads)`.
"""

from __future__ import annotations

import collections
import contextlib
import os

FETCHED: collections.Counter = collections.Counter()  # object key -> bytes returned
WHOLE: list[str] = []                                 # keys fetched whole (no range)


def count_s3_reads() -> int:
    """Start counting in this process (idempotent); returns its pid."""
    import s3fs

    if getattr(s3fs.S3FileSystem._cat_file, "counting", False):
        return os.getpid()
    ranged, downloaded = s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file

    async def cat_file(self, path, version_id=None, start=None, end=None):
        data = await ranged(self, path, version_id=version_id, start=start, end=end)
        FETCHED[path.split("://")[-1]] += len(data)
        if start in (None, 0) and end is None:
            WHOLE.append(path)
        return data

    async def get_file(self, rpath, lpath, **kwargs):
        WHOLE.append(rpath)
        return await downloaded(self, rpath, lpath, **kwargs)

    cat_file.counting = True
    s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file = cat_file, get_file
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their sync methods when made
    return os.getpid()


def s3_reads() -> tuple[int, dict[str, int], list[str]]:
    """(pid, {key: bytes}, [keys fetched whole]) counted so far in this process."""
    return os.getpid(), dict(FETCHED), list(WHOLE)


@contextlib.contextmanager
def counting():
    """Count in this process while inside, from zero, then put s3fs back as it was; yields (FETCHED, WHOLE).

    >>> with counting() as (fetched, whole):   # doctest: +SKIP
    ...     merge_checkpoint("s3://ckpts/run1", "out")
    """
    import s3fs

    saved = s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file
    FETCHED.clear()
    WHOLE.clear()
    count_s3_reads()
    try:
        yield FETCHED, WHOLE
    finally:
        s3fs.S3FileSystem._cat_file, s3fs.S3FileSystem._get_file = saved
        s3fs.S3FileSystem.clear_instance_cache()
