"""The memory budget of a merge: how many output rows a block may hold, and how many blocks a process holds.

Tensors are read, cast, checked and written in row blocks, so a block's memory is bounded by the budget whatever
the largest tensor. `CKPTFLOW_CHUNK_BYTES` sets it (`64MB`, `1GB`, bytes; `0`: whole tensors, the unbounded
path). However many groups and workers run at once (the pipeline merges two groups of two workers), at most
`CKPTFLOW_BLOCKS_IN_FLIGHT` blocks (default 2) are assembled or being written in one process at a time
(`in_flight`): a slow disk or a fast reader cannot make more of them pile up.

>>> rows_per_block((152064, 2048), 2, 64 << 20)
8192
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from ..errors import CheckpointError

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_BLOCKS_IN_FLIGHT = 2
_slots: threading.BoundedSemaphore | None = None
_slots_lock = threading.Lock()
Block = TypeVar("Block")
# A block lives beside one temporary of at most its size (a piece's rows cast to the output dtype).
_COPIES_PER_BLOCK = 2


def chunk_bytes(value: int | str | None = None) -> int:
    """The budget in bytes: `value` when given, else `CKPTFLOW_CHUNK_BYTES`, else 64 MiB; 0 means unbounded."""
    raw = value if value is not None else os.environ.get("CKPTFLOW_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
    try:
        return _parsed(raw)
    except CheckpointError:
        raise CheckpointError(f"CKPTFLOW_CHUNK_BYTES={raw!r}: not a size; write it like 64MB or in bytes (0: unbounded)") from None


@functools.lru_cache(maxsize=8)  # asked once per piece (thousands of ranks: tens of thousands of times)
def _parsed(raw: int | str) -> int:
    return parse_size(raw)


def rows_per_block(shape: tuple[int, ...], itemsize: int, budget: int | None) -> int | None:
    """Rows of a `shape` tensor (dim 0) per block within `budget` bytes (at least one row); None when
    `budget` is 0/None (unbounded) or the tensor is 0-d."""
    if not budget or not shape:
        return None
    row_bytes = itemsize
    for size in shape[1:]:
        row_bytes *= size
    return max(1, budget // (_COPIES_PER_BLOCK * max(1, row_bytes)))


def row_spans(shape: tuple[int, ...], itemsize: int, budget: int | None):
    """`(start, stop)` row ranges covering dim 0 of a `shape` tensor in blocks of `rows_per_block`;
    one span for an unbounded budget, `(0, 1)` for a 0-d tensor, none for zero rows.

    >>> list(row_spans((5, 2), 4, 32))
    [(0, 2), (2, 4), (4, 5)]
    """
    total = shape[0] if shape else 1
    rows = rows_per_block(shape, itemsize, budget) or max(1, total)
    return ((start, min(start + rows, total)) for start in range(0, total, rows))


def parse_size(text: str | int) -> int:
    """`"5GB"` -> 5_000_000_000; `"500MiB"` -> 524_288_000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not match:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; write it like 5GB or 500MB")
    base = 1024 if match[3] else 1000
    return int(float(match[1]) * base ** " KMGT".index(match[2] or " "))


def in_flight(blocks: Iterable[Block]) -> Iterator[Block]:
    """`blocks`, each made and used while holding one of the process's block slots: a slot is taken before a
    block is made (read, cast, checked) and given back when the next one is asked for, or the loop ends.
    Never nest it: a thread holds one slot at a time.

    >>> [block for block in in_flight(iter([1, 2]))]
    [1, 2]
    """
    made = iter(blocks)
    slots = _process_slots()
    while True:
        with slots:
            try:
                block = next(made)
            except StopIteration:
                return
            yield block  # the caller writes it while the slot is held
            del block


def _process_slots() -> threading.BoundedSemaphore:
    global _slots
    with _slots_lock:
        if _slots is None:
            raw = os.environ.get("CKPTFLOW_BLOCKS_IN_FLIGHT", str(DEFAULT_BLOCKS_IN_FLIGHT))
            if not raw.strip().isdigit() or int(raw) < 1:
                raise CheckpointError(f"CKPTFLOW_BLOCKS_IN_FLIGHT={raw!r}: not a count; give a whole number >= 1")
            _slots = threading.BoundedSemaphore(int(raw))
        return _slots
