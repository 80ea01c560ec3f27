"""sha256 of the weight files while they are written: hashing overlaps with merging instead of following it."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from .plan import MergePlan


class BackgroundHashes:
    """sha256 of output files on one background thread. A file is hashed front to back as far as its
    bytes are written (`start_written`), so hashing overlaps with merging instead of following it;
    `start` marks whole files as written.

    >>> hashes = BackgroundHashes(folder); hashes.start(["model-00001-of-00002.safetensors"])  # doctest: +SKIP
    >>> hashes.digests()                                                                  # doctest: +SKIP

    As a context manager it stops its thread on the way out, with whatever work is left abandoned
    (a failed merge, or nothing was ever asked of it).
    """

    _CHUNK = 4 << 20

    def __init__(self, folder: Path):
        self._folder = folder
        self._goal: dict[str, int | None] = {}  # bytes known written; None: the whole file
        self._state: dict[str, tuple] = {}      # file -> (sha256 object, bytes hashed)
        self._done: dict[str, str] = {}
        self._ends: dict[str, tuple[int, list[tuple[str, int]]]] | None = None  # from the plan, on first use
        self._closing = False
        self._error: BaseException | None = None
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def start(self, names: list[str]) -> None:
        with self._wake:
            self._goal.update({name: None for name in names if name not in self._done})
            self._wake.notify()

    def start_written(self, plan: MergePlan, written_groups: set[str]) -> None:
        """Hash each file up to the end of its leading tensors whose groups are written (in any order)."""
        if self._ends is None:  # per file: where the data starts, then (group, end byte) of each tensor in order
            self._ends = {file: (len(plan.header(file)), [(t.group, t.end) for t in plan.in_file(file)])
                          for file in plan.files}
        with self._wake:
            for file, (start, tensors) in self._ends.items():
                if file in self._done or (file in self._goal and self._goal[file] is None):
                    continue
                end, whole = start, True
                for group, tensor_end in tensors:
                    if group not in written_groups:
                        whole = False
                        break
                    end = start + tensor_end
                self._goal[file] = None if whole else max(end, self._goal.get(file) or 0)
            self._wake.notify()

    def digests(self) -> dict[str, str]:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return dict(self._done)

    def abandon(self) -> None:
        """End the thread after its current read, leaving the rest unhashed."""
        with self._wake:
            self._goal.clear()
            self._closing = True
            self._wake.notify()

    def __enter__(self) -> BackgroundHashes:
        return self

    def __exit__(self, *exc) -> None:
        self.abandon()

    def _next(self):
        """A (file, goal) with bytes left to hash, or None."""
        for file, goal in self._goal.items():
            if file not in self._done and (goal is None or goal > self._state.get(file, (None, 0))[1]):
                return file, goal
        return None

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while (work := self._next()) is None and not self._closing:
                        self._wake.wait()
                if work is None:
                    return
                self._advance(*work)
        except BaseException as error:  # noqa: BLE001 - reported by digests()
            self._error = error

    def _advance(self, file: str, goal: int | None) -> None:
        digest, position = self._state.get(file) or (hashlib.sha256(), 0)
        with open(self._folder / file, "rb") as f:
            while goal is None or position < goal:
                block = os.pread(f.fileno(), self._CHUNK if goal is None else min(self._CHUNK, goal - position), position)
                if not block:
                    break
                digest.update(block)
                position += len(block)
        self._state[file] = (digest, position)
        if goal is None:
            self._done[file] = digest.hexdigest()
