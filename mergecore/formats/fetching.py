"""When a reader of remote files downloads a tensor's bytes: with its layer group's, or with one output file's.

Mixed into the readers of remote checkpoints (FSDP rank files, Megatron `model.pt` and `.distcp` files): a merge
by layer group reads a group's tensors together, so the first one asked for brings the whole group's bytes in one
concurrent batch of range requests (round trips per group, not per tensor and rank); a writer of a whole output
file (`remote_writer`) says which tensors come next with `prefetch`, so exactly those are fetched.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cached_property


_PLACES_ONLY: ContextVar[bool] = ContextVar("places_only", default=False)


@contextmanager
def places_only():
    """Inside it, `pieces()` is asked for where each piece sits (offsets, sizes, which file), never for its
    values: remote sources skip downloading the bytes, so drawing an s3:// checkpoint reads metadata only.

    >>> with places_only():  # doctest: +SKIP
    ...     [p.offsets for p in source.pieces("lm_head.weight")]
    """
    token = _PLACES_ONLY.set(True)
    try:
        yield
    finally:
        _PLACES_ONLY.reset(token)


class FetchesByGroup:
    """Subclasses say whether they read remotely (`_reads_remotely`), which tensors they can fetch
    (`_fetchable_names`), and how to download the bytes of some of them (`_download`)."""

    def _reads_remotely(self) -> bool:
        raise NotImplementedError

    def _fetchable_names(self) -> Iterable[str]:
        raise NotImplementedError

    def _download(self, names: list[str]) -> None:
        """Bring the bytes of `names` (every rank's pieces) to local storage, in one batch."""
        raise NotImplementedError

    def prefetch(self, names) -> None:
        if self._reads_remotely():
            self._fetch_missing([n for n in names if n in self._group_of])

    def _fetch_for(self, name: str) -> None:
        """Make `name`'s bytes local: with the rest of its layer group unless they came already (not inside
        `places_only()`, where pieces are asked for their places alone)."""
        if self._reads_remotely() and name not in self._fetched_names and not _PLACES_ONLY.get():
            self._fetch_missing(self._group_members[self._group_of[name]])

    def _fetch_missing(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self._fetched_names]
        if missing:
            self._download(missing)
            self._fetched_names.update(missing)

    @cached_property
    def _fetched_names(self) -> set[str]:
        return set()

    @cached_property
    def _group_of(self) -> dict[str, str]:
        from ..layout import group_of

        return {name: group_of(name)[1] for name in self._fetchable_names()}

    @cached_property
    def _group_members(self) -> dict[str, list[str]]:
        members: dict[str, list[str]] = {}
        for name, group in self._group_of.items():
            members.setdefault(group, []).append(name)
        return members
