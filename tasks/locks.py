"""Group locks that end with their holder: an flock on one file per cache key.

Prefect's FileSystemLockManager marks a held lock by a file its holder deletes on release. A run
that is killed (out of memory, a preempted node, kill -9) never deletes it, so every later run
waits on that group for ever. The kernel drops an flock when its process ends: the next run
simply recomputes the groups a killed run left unfinished.

    locks = FlockLockManager(Path("results/locks"))
    assert locks.acquire_lock("group-key", holder="run-1")
    locks.release_lock("group-key", holder="run-1")

flock works between threads of one process too (each acquire opens the file anew), and on
shared file systems that support it (NFSv4, Lustre with flock enabled).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
from prefect.locking.protocol import LockManager

from mergecore.targets.lock import release_flock, try_flock

POLL_SECONDS = 0.05


class FlockLockManager(LockManager):
    """A LockManager (prefect.locking.protocol) over flock; `hold_timeout` is not needed: a holder
    keeps its lock while it lives and loses it when its process ends."""

    def __init__(self, lock_files_directory: Path):
        self.lock_files_directory = Path(lock_files_directory).expanduser().absolute()
        self._held: dict[str, tuple[str, int]] = {}  # key -> (holder, file descriptor)
        self._guard = threading.Lock()

    def __getstate__(self) -> dict:  # sent to Dask/Ray workers: held descriptors stay here
        return {"lock_files_directory": self.lock_files_directory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["lock_files_directory"])

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        return _poll(lambda: self._try_acquire(key, holder), acquire_timeout)

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                            hold_timeout: float | None = None) -> bool:
        return await _apoll(lambda: self._try_acquire(key, holder), acquire_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        with self._guard:
            if not self.is_lock_holder(key, holder):
                raise ValueError(f"No lock held by {holder} for transaction with key {key}")
            _, descriptor = self._held.pop(key)
        self._remove_and_unlock(key, descriptor)

    def is_locked(self, key: str) -> bool:
        if key in self._held:
            return True
        descriptor = self._lock_file(key)
        if descriptor is None:
            return True
        self._remove_and_unlock(key, descriptor)
        return False

    def is_lock_holder(self, key: str, holder: str) -> bool:
        held = self._held.get(key)
        return held is not None and held[0] == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return _poll(lambda: not self.is_locked(key), timeout)

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return await _apoll(lambda: not self.is_locked(key), timeout)

    def _try_acquire(self, key: str, holder: str) -> bool:
        with self._guard:
            if self.is_lock_holder(key, holder):
                return True
        descriptor = self._lock_file(key)
        if descriptor is None:
            return False
        with self._guard:
            self._held[key] = (holder, descriptor)
        return True

    def _path(self, key: str) -> Path:
        return self.lock_files_directory / f"{key}.lock"

    def _lock_file(self, key: str) -> int | None:
        """A descriptor holding `key`'s flock, or None while someone else holds it."""
        self.lock_files_directory.mkdir(parents=True, exist_ok=True)
        return try_flock(self._path(key), key)

    def _remove_and_unlock(self, key: str, descriptor: int) -> None:
        """Remove the file while still holding it (no litter), then let go."""
        release_flock(self._path(key), descriptor)


def _poll(done, timeout: float | None) -> bool:
    """Check `done()` every POLL_SECONDS until it is true (True) or `timeout` has passed (False)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


async def _apoll(done, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await anyio.sleep(POLL_SECONDS)
    return True
