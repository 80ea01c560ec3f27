"""Streaming safetensors writer: headers first (from the plan), then each tensor at its offset.

Files are pre-sized, so tensors land independently with `os.pwrite`; only the tensor being
written is in memory, however many groups a file holds.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np

from .arrays import dtype_of, to_numpy
from .plan import MergePlan, PlannedTensor


def prepare_files(plan: MergePlan, folder: Path) -> list[str]:
    """Create each output file with its header and full size; keep files already prepared.

    A file is kept when its size and header match the plan, so a resumed merge keeps the
    groups it already wrote; anything else in the folder goes. A folder holding a manifest is a
    finished model (one a crash left before or after its swap into place) and is never resumed.
    Returns the files (re)created, whose groups must be written anew.
    """
    from .output import MANIFEST_FILE, clear_strays

    if (folder / MANIFEST_FILE).exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    clear_strays(folder, set(plan.files))
    created = []
    for file in plan.files:
        path, header, size = folder / file, plan.header(file), plan.file_size(file)
        if path.exists() and path.stat().st_size == size:
            with open(path, "rb") as f:
                if f.read(len(header)) == header:
                    continue
        path.unlink(missing_ok=True)  # a new inode: never write through a hard link to published weights
        with open(path, "wb") as f:
            f.write(header)
            os.posix_fallocate(f.fileno(), 0, size)
        created.append(file)
    return created


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
        if tuple(tensor.shape) != tuple(planned.shape) or dtype_of(tensor) != planned.dtype:
            raise ValueError(f"{planned.name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {planned.shape} {planned.dtype}")
        data = tensor_bytes(tensor)
        if len(data) != planned.end - planned.begin:
            raise ValueError(f"{planned.name}: {len(data)} bytes, planned {planned.end - planned.begin}")
        fd = self._fd(planned.file)
        offset = self._data_start[planned.file] + planned.begin
        while data:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written

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
