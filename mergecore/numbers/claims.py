"""Numbers a checkpoint's metadata claims, bounded by what its folder holds before anything is sized by them.

A world size in `fsdp_config.json` or a rank file's name, the layer numbers in key names, `num_hidden_layers` in
config.json, the shapes, chunks and byte ranges of a DCP `.metadata`: each is a claim, and a claim of 10**18 costs
its writer a few bytes. Code that builds `range(claim)`, a set of it or anything of its size allocates what the
file says, not what the folder holds (a world size of 10**9 beside one rank file grew `inspect` to a MemoryError).
So no reader enumerates a claim: it compares the claim with what is present (the files listed, their sizes), and
the helpers here cost time and memory in what is present only.

>>> absent(10**18, [0, 1, 3])
Absent(count=999999999999999997, lowest=[2])
>>> absent(4, [0, 1, 2, 3])
Absent(count=0, lowest=[])
>>> overclaimed([Extent("w", "__0_0.distcp", 0, 64), Extent("b", "__0_0.distcp", 32, 64)], {"__0_0.distcp": 128}.get)
'w and b claim the same bytes 32..64 of __0_0.distcp'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple


class Absent(NamedTuple):
    """Which of the indices 0..claimed-1 are not present: how many, and the lowest few (for messages)."""

    count: int
    lowest: list[int]


def absent(claimed: int, present: Iterable[int], show: int = 1) -> Absent:
    """The indices of `range(claimed)` that `present` lacks, counted without building that range: time and
    memory go with `present` (the rank files, folders or layers really there), never with `claimed`. Present
    indices outside the range are not counted; callers that refuse them look for them themselves."""
    held = {i for i in present if 0 <= i < claimed}
    # the lowest `show` absent indices lie below len(held) + show: only that many are looked at
    lowest = [i for i in range(min(claimed, len(held) + show)) if i not in held][:show]
    return Absent(max(claimed, 0) - len(held), lowest)


def exactly(claimed: int, present: set[int]) -> bool:
    """Whether `present` is exactly `set(range(claimed))`, decided without building that range.

    >>> exactly(3, {0, 1, 2}), exactly(10**18, {0, 1, 2})
    (True, False)
    """
    return all(0 <= i < claimed for i in present) and absent(claimed, present).count == 0


def places(shape: Iterable[int]) -> int:
    """The elements a shape claims, an empty axis counted as one: what building one object per index of its
    leading axes would cost even when the tensor holds nothing (a `[10**12, 0]` tensor claims 10**12 places)."""
    return math.prod(max(int(size), 1) for size in shape)


class Extent(NamedTuple):
    """Bytes a metadata file claims are stored in a data file: `length` bytes at `offset` of `file`."""

    what: str  # what is stored there, for messages
    file: str
    offset: int
    length: int


def overclaimed(extents: Iterable[Extent], size_of: Callable[[str], int | None]) -> str | None:
    """Why `extents` claim more bytes than their files hold, or None: one reaching past its file's real size
    (`size_of(file)`; None when the file is absent, which holds nothing), or two claiming the same bytes (each
    stored item has bytes of its own, so no count derived from them can exceed the bytes really there)."""
    by_file: dict[str, list[Extent]] = {}
    for extent in extents:
        size = size_of(extent.file)
        if size is None:
            return f"{extent.what} is stored in {extent.file}, which is absent"
        if extent.offset + extent.length > size:
            return f"{extent.what} is stored at bytes {extent.offset}+{extent.length} of {extent.file}, which has {size}"
        if extent.length:
            by_file.setdefault(extent.file, []).append(extent)
    for file, held in by_file.items():
        held.sort(key=lambda e: e.offset)
        for before, after in zip(held, held[1:]):
            if after.offset < before.offset + before.length:
                end = min(before.offset + before.length, after.offset + after.length)
                return f"{before.what} and {after.what} claim the same bytes {after.offset}..{end} of {file}"
    return None
