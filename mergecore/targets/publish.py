"""Publishing a finished folder at its target so that a reader sees the old model or the new one, never a mix.

On Linux the staging folder and an existing target are swapped in one `renameat2(RENAME_EXCHANGE)`;
a new target appears by one `renameat2(RENAME_NOREPLACE)`. Every file and both folders are fsynced
before the swap, and the parent after it, so a power cut cannot publish names without their bytes.

Where renameat2 is missing (other systems, file systems that refuse the flag) an existing target is
replaced by two renames: target -> `.NAME.ckptflow-retired-*`, staging -> target. Between them the
target is briefly absent; `repair_target` (run before every merge into that target) puts a retired
model back if a crash left the target missing, and removes retired folders otherwise.

>>> publish(Path(".model.ckptflow-partial"), Path("model"), overwrite=True)  # doctest: +SKIP
PosixPath('/abs/model')
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import uuid
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(source: Path, destination: Path, flags: int) -> bool:
    """True when done; False when this system or file system cannot do it (use the fallback)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if call(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(destination))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(paths: list[Path]) -> threading.Thread:
    """Have the kernel start writing `paths` to disk now, from a background thread (Linux `sync_file_range` with
    SYNC_FILE_RANGE_WRITE, which can block while it queues the writes): the disk works while the round-trip check
    keeps the CPUs busy, and the fsync before publishing has little left to wait for. Elsewhere it does nothing
    (the fsync still syncs everything)."""

    def queue_writes() -> None:
        try:
            call = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (AttributeError, OSError):
            return
        call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        for path in paths:
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except OSError:
                return  # the merge failed and took its staging folder: nothing to write
            try:
                call(descriptor, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a hint: its result changes nothing we do
            finally:
                os.close(descriptor)

    thread = threading.Thread(target=queue_writes, name="writeback", daemon=True)
    thread.start()
    return thread


def sync_folder(folder: Path) -> None:
    """fsync every file and folder below `folder` (a LoRA merge's `lora_adapter/` too), then `folder` itself."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            sync_folder(entry)
        elif entry.is_file():
            _fsync(entry)
    _fsync(folder)


def retired_folders(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.ckptflow-retired-*"))


def repair_target(target: Path) -> None:
    """Finish what a crash during `publish` left: restore the old model if the target went missing
    between the fallback's two renames, then remove every retired folder."""
    target = Path(target).absolute()
    retired = retired_folders(target)
    if retired and not os.path.lexists(target):
        newest = max(retired, key=lambda p: p.stat().st_mtime_ns)
        os.rename(newest, target)
        retired.remove(newest)
    for folder in retired:
        shutil.rmtree(folder, ignore_errors=True)


def publish(staging: Path, target: Path, overwrite: bool) -> Path:
    """Make the finished `staging` folder the `target`, atomically; the old target is removed afterwards."""
    target = Path(target).absolute()
    sync_folder(staging)
    retired = target.parent / f".{target.name}.ckptflow-retired-{uuid.uuid4().hex[:8]}"
    if os.path.lexists(target):
        if not overwrite and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} exists")
        if _renameat2(staging, target, _RENAME_EXCHANGE):
            os.rename(staging, retired)  # the old model leaves the staging name, which is never resumed from
        else:
            os.rename(target, retired)
            os.rename(staging, target)
    elif not _renameat2(staging, target, _RENAME_NOREPLACE):
        os.rename(staging, target)
    _fsync(target.parent)
    shutil.rmtree(retired, ignore_errors=True)
    return target
