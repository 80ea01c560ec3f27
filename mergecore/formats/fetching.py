"""When a reader makes a tensor's bytes ready to read: downloaded (remote files) and CRC-checked (all files),
with its layer group's, or exactly the tensors of one output file when a writer names them (`prefetch`).

Mixed into the readers of torch.save archives (FSDP rank files, Megatron `model.pt` and `.distcp` files): a merge
by layer group reads a group's tensors together, so the first one asked for brings the whole group's bytes in one
concurrent batch of range requests (round trips per group, not per tensor and rank); a writer of a whole output
file (`remote_writer`) says which tensors come next with `prefetch`, so exactly those are fetched. Before any of
a group's bytes are handed out, the CRC-32 of every zip member behind it is checked once (`torchfile.check_crc`,
on a few threads), locally mapped or downloaded alike: a damaged file is refused by name, never merged.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cached_property

from .torchfile import check_crc


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
    (`_fetchable_names`), how to download the bytes of some of them (`_download`: whole zip members, so their
    CRC can be checked) and which saved arrays hold them (`_saved_arrays`)."""

    def _reads_remotely(self) -> bool:
        raise NotImplementedError

    def _fetchable_names(self) -> Iterable[str]:
        raise NotImplementedError

    def _download(self, names: list[str]) -> None:
        """Bring the bytes of `names` (every rank's pieces) to local storage, in one batch."""
        raise NotImplementedError

    def _saved_arrays(self, names: list[str]) -> Iterable:
        """The arrays, as loaded (views of the mapped archives), that hold the bytes of `names`."""
        raise NotImplementedError

    def prefetch(self, names) -> None:
        """Make exactly `names` ready (downloaded and CRC-checked) in one batch, and nothing else: a writer of one
        output file asks for its tensors, which may be part of a layer group whose rest another file holds (the
        final norm beside `lm_head`), and that rest must not be fetched here too."""
        self._make_ready([n for n in names if n in self._group_of])

    def _ready_for(self, name: str) -> None:
        """Make `name`'s bytes ready to read, with the rest of its layer group unless they are already: local
        (downloaded) and checked against their CRC-32. Every reader calls it before handing bytes out; inside
        `places_only()` pieces are asked for their places alone, so nothing is fetched or checked."""
        if name not in self._ready_names and not _PLACES_ONLY.get():
            self._make_ready(self._group_members[self._group_of[name]])

    def _make_ready(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self._ready_names]
        if missing:
            if self._reads_remotely():
                self._fetch_missing(missing)
            check_crc(self._saved_arrays(missing))
            self._ready_names.update(missing)

    def _fetch_missing(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self._fetched_names]
        if missing:
            self._download(missing)
            self._fetched_names.update(missing)

    @cached_property
    def _fetched_names(self) -> set[str]:
        return set()

    @cached_property
    def _ready_names(self) -> set[str]:
        return set()

    @cached_property
    def _group_of(self) -> dict[str, str]:
        from ..families.layout import group_of

        return {name: group_of(name)[1] for name in self._fetchable_names()}

    @cached_property
    def _group_members(self) -> dict[str, list[str]]:
        members: dict[str, list[str]] = {}
        for name, group in self._group_of.items():
            members.setdefault(group, []).append(name)
        return members
