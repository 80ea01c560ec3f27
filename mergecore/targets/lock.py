"""One lock per target, held by every writer from staging to publish.

The lock is an flock on a small file beside the target (`.NAME.ckptflow-lock`), so it ends with its
holder's process: a run killed with -9 never blocks the next one. It is re-entrant within a process (the
CLI's merge, the flow around its tasks and the tasks themselves may all ask for it) and exclusive between
processes. A second writer waits, saying once what it waits for, up to `CKPTFLOW_LOCK_TIMEOUT` seconds
(default 3600), then fails in one line.

The lock file is opened with O_NOFOLLOW: a link planted at its name is refused, never followed.

>>> with target_lock(Path("/tmp/.model.ckptflow-lock"), "/tmp/model"):  # doctest: +SKIP
...     publish()
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from ..storage.retries import lock_timeout

POLL_SECONDS = 0.1

_held: dict[str, list] = {}  # lock file -> [descriptor, depth]: the locks this process holds
_guard = threading.RLock()


def _say(message: str) -> None:
    print(f"ckptflow: {message}", file=sys.stderr, flush=True)


@contextmanager
def target_lock(lock_file: Path, target: str, timeout: float | None = None, on_wait: Callable[[str], None] = _say):
    """Hold `target`'s lock (the flock of `lock_file`) for a `with` block, waiting for another holder."""
    key = os.fspath(lock_file)
    with _guard:
        if key in _held:  # this process holds it already (the flow around this task, the CLI around the flow)
            _held[key][1] += 1
            acquired = False
        else:
            acquired = True
    if acquired:
        descriptor = _acquire(Path(lock_file), target, lock_timeout() if timeout is None else timeout, on_wait)
        with _guard:
            _held[key] = [descriptor, 1]
    try:
        yield
    finally:
        with _guard:
            entry = _held[key]
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _held[key]
        if last:
            release_flock(Path(lock_file), entry[0])


def holds(lock_file: Path) -> bool:
    """Whether this process holds the lock of `lock_file`."""
    with _guard:
        return os.fspath(lock_file) in _held


def _acquire(lock_file: Path, target: str, timeout: float, on_wait: Callable[[str], None]) -> int:
    deadline = time.monotonic() + timeout
    told = False
    while True:
        descriptor = try_flock(lock_file, target)
        if descriptor is not None:
            return descriptor
        if not told:
            on_wait(f"{target}: another ckptflow run is writing it; waiting up to {timeout:.0f} s "
                    "(CKPTFLOW_LOCK_TIMEOUT)")
            told = True
        if time.monotonic() >= deadline:
            raise CheckpointError(f"{target}: another ckptflow run held it for {timeout:.0f} s (lock {lock_file}); "
                                  "wait for it to finish, or raise CKPTFLOW_LOCK_TIMEOUT")
        time.sleep(POLL_SECONDS)


def try_flock(lock_file: Path, target: str) -> int | None:
    """A descriptor holding the flock of `lock_file` (made if missing), or None while someone else holds it."""
    try:
        descriptor = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"{lock_file}: is a symbolic link, not ckptflow's lock of {target}; remove it "
                                  "(someone may be trying to redirect ckptflow's writes)") from None
        raise
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    if not _same_file(descriptor, lock_file):  # its last holder removed it after we opened it: try again
        os.close(descriptor)
        return try_flock(lock_file, target)
    return descriptor


def release_flock(lock_file: Path, descriptor: int) -> None:
    """Remove the file while still holding it (no litter beside the target), then let go."""
    if _same_file(descriptor, lock_file):
        lock_file.unlink(missing_ok=True)
    os.close(descriptor)


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(descriptor).st_ino
    except FileNotFoundError:
        return False
