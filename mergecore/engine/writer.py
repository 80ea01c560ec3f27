"""Streaming safetensors writer: headers first (from the plan), then each tensor at its offset.

Files are pre-sized, so tensors (and row blocks of a tensor) land independently with `os.pwrite`;
only the block being written is in memory, however large the tensor and however many groups a file holds.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..numbers.arrays import dtype_of, numpy_dtype, to_numpy
from ..numbers.budget import in_flight
from ..errors import CheckpointError
from ..numbers.nonfinite import checked_blocks
from .plan import MergePlan, PlannedTensor
from ..quantize.stream import quantized_blocks
from ..model.folder import PARTIAL_SUFFIX, clear_strays

NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # disk full, file-size limit, quota
# Room kept for what follows the weights (index, config, manifest, copied tokenizer files: a large
# tokenizer.json is ~10 MB) when the caller does not know their size.
METADATA_SLACK = 16 << 20


def output_target(folder: Path) -> Path:
    """The target a staging folder is published to; any other folder is its own target."""
    name = folder.name
    if name.startswith(".") and name.endswith(PARTIAL_SUFFIX):
        return folder.parent / name[1:-len(PARTIAL_SUFFIX)]
    return folder


@contextmanager
def room_checked(folder: Path):
    """Running out of room while writing into `folder` becomes a one-line CheckpointError with the fix.

    Other OSErrors pass through unchanged (the pipeline retries them as transient).
    """
    try:
        yield
    except OSError as error:
        if error.errno not in NO_ROOM:
            raise
        raise CheckpointError(
            f"{output_target(folder)}: {os.strerror(error.errno)} while writing the merged model into {folder}; "
            "free space on that disk (or raise the quota / file-size limit) or choose another --target_dir"
        ) from error


def check_free_space(needed: int, free: int, target: Path) -> None:
    """Refuse, before anything is written, a merge that cannot fit in the free bytes of the target's disk.

    >>> check_free_space(2_000_000_000, 500_000_000, Path("out/model"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: out/model: needs 2.00 GB but its disk has 500.0 MB free; ...
    """
    if needed > free:
        raise CheckpointError(
            f"{target}: needs {readable_size(needed)} but its disk has {readable_size(free)} free; "
            "free space on that disk or choose another --target_dir"
        )


def readable_size(size: int) -> str:
    """`readable_size(1_500_000) == "1.5 MB"`."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{size} bytes"


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds (or will hold) `folder`."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def prepare_files(plan: MergePlan, folder: Path, metadata_bytes: int = METADATA_SLACK) -> list[str]:
    """Create each output file with its header and full size; keep files already prepared.

    A file is kept when its size and header match the plan, so a resumed merge keeps the
    groups it already wrote; anything else in the folder goes (`targets.LocalTarget.open_staging` has already
    set aside a finished model a crash left under the staging name). Returns the files (re)created, whose groups must be written anew.
    Refuses first, writing nothing, when the files to create and `metadata_bytes` exceed the free space.
    """

    if folder.exists():
        clear_strays(folder, set(plan.files))
    stale = [file for file in plan.files if not _prepared(folder / file, plan.header(file), plan.file_size(file))]
    needed = sum(plan.file_size(file) for file in stale) + metadata_bytes
    check_free_space(needed, free_bytes(folder), output_target(folder))
    with room_checked(folder):
        folder.mkdir(parents=True, exist_ok=True)
        for file in stale:
            path = folder / file
            path.unlink(missing_ok=True)  # a new inode: never write through a hard link to published weights
            with open(path, "wb") as f:
                f.write(plan.header(file))
                os.posix_fallocate(f.fileno(), 0, plan.file_size(file))
    return stale


def _prepared(path: Path, header: bytes, size: int) -> bool:
    if not (path.exists() and path.stat().st_size == size):
        return False
    with open(path, "rb") as f:
        return f.read(len(header)) == header


def tensor_bytes(array) -> memoryview:
    """The raw little-endian bytes of an array (or torch tensor), without a copy when it is contiguous."""
    flat = np.ascontiguousarray(to_numpy(array)).reshape(-1)
    return memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")


class TensorWriter:
    """Writes planned tensors into the prepared files of one folder.

    >>> with TensorWriter(plan, folder) as writer:      # doctest: +SKIP
    ...     writer.write(planned, tensor)
    """

    def __init__(self, plan: MergePlan, folder: Path):
        self._plan = plan
        self._folder = folder
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # workers share one descriptor per file
        self._data_start = {file: len(plan.header(file)) for file in plan.files}

    def write(self, planned: PlannedTensor, tensor) -> None:
        if tuple(tensor.shape) != tuple(planned.shape):
            raise ValueError(f"{planned.name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {planned.shape} {planned.dtype}")
        self.write_rows(planned, 0, tensor)

    def write_rows(self, planned: PlannedTensor, start: int, block) -> None:
        """Write `block`, rows [start, start + len(block)) of the planned tensor (a 0-d tensor: itself, at 0),
        straight into its place in the file.

        >>> writer.write_rows(planned, 8192, embedding_rows)   # doctest: +SKIP
        """
        shape = tuple(planned.shape)
        whole = not shape or (start == 0 and tuple(block.shape) == shape)
        fits = whole or (tuple(block.shape[1:]) == shape[1:] and 0 <= start and start + block.shape[0] <= shape[0])
        if not fits or (dtype_of(block) != planned.dtype and to_numpy(block).dtype != numpy_dtype(planned.dtype)):
            raise ValueError(f"{planned.name}: got rows {start}.. of {tuple(block.shape)} {block.dtype}, "
                             f"planned {planned.shape} {planned.dtype}")
        data = tensor_bytes(block)
        row_bytes = (planned.end - planned.begin) // shape[0] if shape and shape[0] else 0
        expected = planned.end - planned.begin if whole else row_bytes * block.shape[0]
        if len(data) != expected:
            raise ValueError(f"{planned.name}: {len(data)} bytes for rows {start}.., planned {planned.end - planned.begin} in all")
        offset = self._data_start[planned.file] + planned.begin + start * row_bytes
        with room_checked(self._folder):
            fd = self._fd(planned.file)
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written

    def write_tensor(self, source, entry: PlannedTensor, budget: int | None, on_nonfinite: str, found: dict) -> None:
        """Read planned tensor `entry` from `source` in row blocks within `budget`, check each for NaN/Inf
        (`nonfinite.checked_blocks`) and write it; a quantized weight's parts are all written, block by block, when its
        primary part comes (`quantize.stream`), the other parts then being no-ops.

        >>> writer.write_tensor(source, plan.in_group("layers.0")[0], 64 << 20, "warn", {})  # doctest: +SKIP
        """
        if entry.part is None:
            blocks = ((entry, start, block) for start, block in checked_blocks(source, entry, budget, on_nonfinite, found))
        else:
            blocks = quantized_blocks(source, self._plan, entry, budget, on_nonfinite)  # never NaN/Inf: none to count
        for planned, start, block in in_flight(blocks):
            self.write_rows(planned, start, block)
            del block  # the next block is read while this one would otherwise still be held

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self._folder / file, os.O_WRONLY)
            return self._fds[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
