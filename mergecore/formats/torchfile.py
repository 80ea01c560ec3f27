"""Read `torch.save` files without torch: tensors come back as read-only numpy views of the mmapped file.

A torch.save file is an uncompressed zip. `<archive>/data.pkl` pickles the object tree, naming each
tensor storage by a key whose raw little-endian bytes are the member `<archive>/data/<key>`. The
pickle is unpickled through an allow-list (`untrusted.TORCH_FILE` by default): storages become
numpy views of their own member's bytes, tensors strided views inside those, and classes that only
describe a layout (DTensor's spec and device mesh, ShardedTensor's metadata, placements) become
inert records of their pickled fields. Nothing else is imported or called, so a file cannot run
code; and since records keep whatever fields were pickled, files from different torch versions
read alike (their DeviceMesh internals differ: see `untrusted.MeshRecord`).

The archive itself is untrusted too: duplicate member names (zipfile would silently take the last),
members outside the archive or overlapping one another, compressed members (torch.save never
compresses: a compressed member can only be a decompression bomb or a repacked file) and storages
larger than their member are refused, before any member is read. torch.save records a CRC-32 for
every member: data.pkl is checked as it is read (zipfile), and a tensor member's bytes, which are
mapped rather than read, by `check_crc` once per member, before a reader hands them out.

>>> state = load("model_world_size_2_rank_0.pt", "rank 0")   # doctest: +SKIP
>>> state["lm_head.weight"].placements, state["lm_head.weight"].local.shape  # doctest: +SKIP
((Shard(dim=0),), (500, 64))
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import pickle
import struct
import threading
import weakref
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..numbers.arrays import numpy_dtype
from ..errors import CheckpointError
from .untrusted import TORCH_FILE, AllowListUnpickler, DTensorRecord, MeshRecord, Record, ShardedTensorRecord

__all__ = ["DTensorRecord", "MeshRecord", "Record", "ShardedTensorRecord", "check_crc", "load", "member_span"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version..sizes), name length, extra length


class _Window(io.RawIOBase):
    """The first `end` bytes of a mapped file as a seekable stream, without copying them."""

    def __init__(self, raw, end: int):
        self._raw, self._end, self._pos = raw, end, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, min(self._end, (0, self._pos, self._end)[whence] + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._end - self._pos)
        buffer[:n] = self._raw[self._pos:self._pos + n]
        self._pos += n
        return n


def _members(raw, archive: zipfile.ZipFile, start: int, end: int) -> dict[str, tuple[zipfile.ZipInfo, int]]:
    """Member name (archive folder stripped) -> (info, where its bytes start), each checked to lie
    inside [start, end) and apart from every other member; duplicate names are refused."""
    members: dict[str, tuple[zipfile.ZipInfo, int]] = {}
    spans = []
    for info in archive.infolist():
        name = info.filename.split("/", 1)[-1]
        if name in members:
            raise ValueError(f"the archive holds {name} twice (zip readers keep only one): it was tampered with")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _Compressed(info)
        header = raw[info.header_offset:info.header_offset + _LOCAL_HEADER.size]
        if info.header_offset < start or len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise ValueError(f"bad local header for {info.filename}")
        name_length, extra_length = _LOCAL_HEADER.unpack(header)[1:]
        data = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        local_name = raw[info.header_offset + _LOCAL_HEADER.size:info.header_offset + _LOCAL_HEADER.size + name_length]
        if local_name != info.filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise ValueError(f"the local header of {info.filename} names another member")
        if data + info.compress_size > end:
            raise ValueError(f"member {info.filename} runs past the end of the archive")
        spans.append((info.header_offset, data + info.compress_size, info.filename))
        members[name] = (info, data)
    spans.sort()
    for (_, stop, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < stop:
            raise ValueError(f"members {first} and {second} overlap: the archive was tampered with")
    return members


class _Compressed(ValueError):
    """A compressed member: refused before anything is inflated (a 796-byte bzip2 member can inflate to 1 GiB)."""

    def __init__(self, info: zipfile.ZipInfo):
        method = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(
            info.compress_type, f"method {info.compress_type}")
        super().__init__(f"member {info.filename} is compressed ({method}, {info.compress_size} bytes declaring "
                         f"{info.file_size})")


class _ArchiveMap(mmap.mmap):
    """A mapped torch.save file; `load` sets `crcs`, the CRC-32 its zip directory records per member."""

    crcs: _MemberCrcs | None = None


class _MemberCrcs:
    """One archive's members by where their bytes start in the file: (name, size, recorded CRC-32); which
    were checked already; and which storage array views which member (by weak reference: no cycle through
    the map, and a storage's id is trusted only while that very array is alive)."""

    def __init__(self, shown_as: str, members: dict[str, tuple[zipfile.ZipInfo, int]]):
        self.shown_as = shown_as
        self.by_start = {start: (info.filename, info.file_size, info.CRC) for info, start in members.values()}
        self.checked: set[int] = set()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def note(self, storage: np.ndarray, start: int) -> None:
        self.storages[id(storage)] = (weakref.ref(storage), start)


def load(path: str, shown_as: str, offset: int = 0, length: int | None = None,
         allowed: Mapping[tuple[str, str], object] = TORCH_FILE):
    """The object a `torch.save` file holds, with tensors as read-only numpy views (mmap: nothing is read yet).

    `offset`/`length` select a torch.save archive stored inside a larger file (a DCP `.distcp` item).
    `allowed` is the allow-list (`untrusted.megatron_file()` for Megatron files). Bad files raise a one-line
    CheckpointError naming `shown_as`.
    """
    try:
        if type(offset) is not int or offset < 0 or (length is not None and (type(length) is not int or length < 0)):
            raise ValueError(f"byte range {offset!r}+{length!r} is not a range of the file")
        with open(path, "rb") as f:
            raw = _ArchiveMap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        end = len(raw) if length is None else offset + length
        if end > len(raw):
            raise ValueError(f"{end - len(raw)} bytes missing at the end")
        # zipfile finds the archive from its end record; bytes before `offset` count as prepended data
        archive = zipfile.ZipFile(_Window(raw, end))
        members = _members(raw, archive, offset, end)
        if raw:
            raw.crcs = _MemberCrcs(shown_as, members)
        if "data.pkl" not in members:
            raise ValueError("no data.pkl: not a torch.save zip archive")
        if "byteorder" in members and archive.read(members["byteorder"][0]).strip() not in (b"little", b""):
            raise ValueError("big-endian storages are not supported")
        pickled = archive.read(members["data.pkl"][0])  # zipfile checks its CRC-32
    except _Compressed as err:
        raise CheckpointError(
            f"{shown_as}: {err}; torch.save never compresses, so this file was repacked or crafted and is not "
            "read: copy the original from where training saved it"
        ) from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(
            f"{shown_as}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or not a "
            "torch checkpoint: copy it again from where training saved it"
        ) from None
    storages: dict[str, np.ndarray] = {}

    def storage(key: str, dtype: str, numel: int) -> np.ndarray:
        """The storage `key` as a view of its own member's bytes, never beyond them."""
        if key not in storages:
            info, start = members.get(f"data/{key}", (None, 0))
            if info is None or info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise pickle.UnpicklingError(f"storage {key} is missing or compressed")
            element = numpy_dtype(dtype)
            if numel * element.itemsize > info.file_size:
                raise pickle.UnpicklingError(f"storage {key} holds {info.file_size} bytes, fewer than {numel} {dtype}")
            storages[key] = np.frombuffer(raw, element, count=numel, offset=start)
            raw.crcs.note(storages[key], start)
        elif storages[key].dtype != numpy_dtype(dtype) or storages[key].size != numel:
            raise pickle.UnpicklingError(f"storage {key} is declared twice, differently")
        return storages[key]

    unpickler = AllowListUnpickler(io.BytesIO(pickled), allowed, storage=storage, file_bytes=end - offset)
    try:
        return unpickler.load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, AttributeError, KeyError,
            RecursionError, MemoryError, OverflowError) as err:
        raise CheckpointError(
            f"{shown_as}: refused to unpickle ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            "ckptflow only loads tensors, never arbitrary objects"
        ) from None


# ---- reading remote archives by byte range ------------------------------------------------------

_END_RECORD = b"PK\x05\x06"
_END_SEARCH = 65536 + 22  # the end record sits within the last 64 KiB comment + its own 22 bytes
_END_RECORDS = 22 + 20 + 56  # end record, zip64 locator and zip64 end record, when there is no comment
_EXTRA_SLACK = 256        # room for a local header's extra field (torch pads data to 64 bytes with it)


def fetch_archive_metadata(fetch, path: str, size: int, shown_as: str, offset: int = 0, length: int | None = None,
                           header_slack: int = _EXTRA_SLACK) -> None:
    """Make present in the sparse file `path` every byte `load` reads before any tensor value: the end
    records, the central directory, each member's local header and the small members (data.pkl, byteorder...).

    `fetch(ranges, join_gap)` downloads `[start, end)` ranges into `path`. Three or four batches of requests
    whatever the number of tensors; tensor bytes are fetched later, per member (`member_span`), so headers
    are never joined across the tensor bytes between them. `offset`/`length` select an archive stored inside
    a larger file, as for `load`. `header_slack`: bytes fetched past a tensor member's name in the first
    batch, in the hope they cover its extra field (saving the fourth batch); they reach into the tensor's
    data, so pass 0 for archives holding tensors that must never be read (Megatron's optimizer state).

    >>> fetch_archive_metadata(remote.fetch, remote.path, remote.size, "rank 0")   # doctest: +SKIP
    """
    fetch = functools.partial(fetch, join_gap=0)
    end_of_archive = size if length is None else min(size, offset + length)
    try:
        with open(path, "rb") as f:
            for search in (_END_RECORDS, _END_SEARCH):  # end records without a comment first: no byte of the data
                tail_start = max(offset, end_of_archive - search)
                fetch([(tail_start, end_of_archive)])
                f.seek(tail_start)
                tail = f.read(end_of_archive - tail_start)
                end = tail.rfind(_END_RECORD)
                if 0 <= end <= len(tail) - 22 and end + 22 + struct.unpack_from("<H", tail, end + 20)[0] == len(tail):
                    break
            if end < 0 or end + 22 > len(tail):
                raise ValueError("no zip end record")
            directory_size, directory_start = struct.unpack_from("<II", tail, end + 12)
            if 0xFFFFFFFF in (directory_size, directory_start) and end >= 20 + 56:
                record = struct.unpack_from("<Q", tail, end - 20 + 8)[0] - tail_start + offset  # zip64 end record
                directory_size, directory_start = struct.unpack_from("<QQ", tail, record + 40)
            fetch([(min(offset + directory_start, end_of_archive), end_of_archive)])
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:  # zipfile finds the window's own end record
                infos = zipfile.ZipFile(_Window(raw, end_of_archive)).infolist()
            wanted = [(info, info.filename.split("/", 1)[-1].startswith("data/")) for info in infos]
            fetch([(i.header_offset, i.header_offset + _LOCAL_HEADER.size + len(i.filename.encode())
                    + (header_slack if tensor else _EXTRA_SLACK + i.compress_size)) for i, tensor in wanted])
            exact = []
            for info, tensor in wanted:
                f.seek(info.header_offset)
                name_length, extra_length = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))[1:]
                header_end = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
                exact.append((info.header_offset, header_end + (0 if tensor else info.compress_size)))
            fetch(exact)  # only what the slack did not cover
    except (ValueError, struct.error, zipfile.BadZipFile) as err:
        raise CheckpointError(
            f"{shown_as}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or not a "
            "torch checkpoint: copy it again from where training saved it"
        ) from None


def mapped_span(array) -> tuple[int, int] | None:
    """The [start, end) bytes of the mmapped file that `array` (a view `load` returned) spans; None when
    it does not view a mapped file (or holds no bytes)."""
    if not isinstance(array, np.ndarray) or array.size == 0:
        return None
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None:
        return None
    origin = np.frombuffer(base, np.uint8, count=1).ctypes.data
    low, high = np.lib.array_utils.byte_bounds(array)
    return low - origin, high - origin


# ---- CRC-32 of the members a reader hands out -----------------------------------------------------

CRC_SWITCH = "CKPTFLOW_CHECK_CRC"  # "0" turns the check off (for benchmarks); anything else, or unset, keeps it on
try:  # ISA-L's CRC-32 (python-isal) runs ~3x zlib's here (8.4 vs 2.5 GB/s); the same checksum
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32
_CRC_THREADS = 4  # crc32 releases the GIL on large buffers: members are checked side by side
_POOL_MIN_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _member_behind(array) -> tuple[_ArchiveMap, int] | None:
    """(the mapped archive, where the member's bytes start) of a view `load` returned; None for any other array."""
    if not isinstance(array, np.ndarray) or array.size == 0:
        return None
    storage, base = array, array.base
    while isinstance(base, np.ndarray):  # a view's base is the storage array np.frombuffer made over the map
        storage, base = base, base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, _ArchiveMap) or base.crcs is None:
        return None
    noted = base.crcs.storages.get(id(storage))
    return (base, noted[1]) if noted is not None and noted[0]() is storage else None


def member_span(array) -> tuple[int, int] | None:
    """The [start, end) bytes of the whole zip member behind `array` (a view `load` returned), which a
    remote reader fetches so that `check_crc` can check it; else `mapped_span(array)`."""
    found = _member_behind(array)
    if found is None:
        return mapped_span(array)
    raw, start = found
    return start, start + raw.crcs.by_start[start][1]


def check_crc(arrays: Iterable) -> None:
    """Check the CRC-32 torch.save recorded for every zip member behind `arrays` (views `load` returned;
    other arrays are passed over), each member once per loaded file; members are checked on a few threads.
    A mismatch is a one-line CheckpointError naming the file and the member. Off when the environment sets
    CKPTFLOW_CHECK_CRC=0.

    >>> check_crc([state["lm_head.weight"].local])  # doctest: +SKIP
    """
    if os.environ.get(CRC_SWITCH, "1").strip() == "0":
        return
    todo: dict[tuple[int, int], tuple[_ArchiveMap, int]] = {}
    for array in arrays:
        found = _member_behind(array)
        if found is not None and found[1] not in found[0].crcs.checked:
            todo[(id(found[0]), found[1])] = found
    # large members side by side on the pool; small ones (norms, biases, thousands of tiny ranks) here, where a
    # pool's hand-off would cost more than their CRC
    large, small = [], []
    for found in todo.values():
        (large if found[0].crcs.by_start[found[1]][1] >= _POOL_MIN_BYTES else small).append(found)
    if len(large) < 2:
        large, small = [], small + large
    queued = [_crc_pool().submit(_check_member, *found) for found in large]
    for found in small:
        _check_member(*found)
    for job in queued:
        job.result()  # the first mismatch raises here


def _crc_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_CRC_THREADS, thread_name_prefix="ckptflow-crc")
        return _pool


def _check_member(raw: _ArchiveMap, start: int) -> None:
    crcs = raw.crcs
    if start in crcs.checked:  # two threads may both check a member: harmless, and rarer than a lock is costly
        return
    name, size, recorded = crcs.by_start[start]
    with memoryview(raw) as whole:
        found = crc32(whole[start:start + size])
    if found != recorded:
        raise CheckpointError(
            f"{crcs.shown_as}: member {name} fails its CRC-32 check ({found:08x}, recorded {recorded:08x}): "
            "its bytes changed after torch saved it (disk, copy or transfer damage); copy the file again from "
            "where training saved it"
        )
    crcs.checked.add(start)
