"""Group locks: exclusive between threads and processes, and gone when their process dies."""

from __future__ import annotations

import asyncio
import pickle
import signal
import subprocess
import sys

import pytest

from ckptflow.tasks.locks import FlockLockManager

HOLD_UNTIL_KILLED = """
import sys, time
from pathlib import Path
from ckptflow.tasks.locks import FlockLockManager
assert FlockLockManager(Path(sys.argv[1])).acquire_lock("group", holder="other-process")
print("held", flush=True)
time.sleep(600)
"""


def test_one_holder_at_a_time_and_no_litter(tmp_path):
    locks = FlockLockManager(tmp_path / "locks")
    assert locks.acquire_lock("group", holder="run-1")
    assert locks.acquire_lock("group", holder="run-1")  # re-entrant for its holder
    assert locks.is_locked("group") and locks.is_lock_holder("group", "run-1")
    assert not locks.acquire_lock("group", holder="run-2", acquire_timeout=0.2)
    assert not FlockLockManager(tmp_path / "locks").acquire_lock("group", holder="run-2", acquire_timeout=0.2)
    with pytest.raises(ValueError, match="run-2"):
        locks.release_lock("group", holder="run-2")

    locks.release_lock("group", holder="run-1")
    assert not locks.is_locked("group") and list((tmp_path / "locks").iterdir()) == []
    assert asyncio.run(locks.aacquire_lock("group", holder="run-2", acquire_timeout=1))
    copy = pickle.loads(pickle.dumps(locks))  # as sent to a Dask worker: holds nothing of ours
    assert copy.is_locked("group") and not copy.is_lock_holder("group", "run-2")


def test_a_killed_holder_frees_its_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_UNTIL_KILLED, str(tmp_path / "locks")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        locks = FlockLockManager(tmp_path / "locks")
        assert locks.is_locked("group") and not locks.wait_for_lock("group", timeout=0.2)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert locks.acquire_lock("group", holder="next-run", acquire_timeout=5)
    finally:
        holder.kill()
