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
members outside the archive or overlapping one another, and storages larger than their member are
refused.

>>> state = load("model_world_size_2_rank_0.pt", "rank 0")   # doctest: +SKIP
>>> state["lm_head.weight"].placements, state["lm_head.weight"].local.shape  # doctest: +SKIP
((Shard(dim=0),), (500, 64))
"""

from __future__ import annotations

import functools
import io
import mmap
import pickle
import struct
import zipfile
from collections.abc import Mapping

import numpy as np

from ..arrays import numpy_dtype
from ..errors import CheckpointError
from .untrusted import TORCH_FILE, AllowListUnpickler, DTensorRecord, MeshRecord, Record, ShardedTensorRecord

__all__ = ["DTensorRecord", "MeshRecord", "Record", "ShardedTensorRecord", "load"]

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
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        end = len(raw) if length is None else offset + length
        if end > len(raw):
            raise ValueError(f"{end - len(raw)} bytes missing at the end")
        # zipfile finds the archive from its end record; bytes before `offset` count as prepended data
        archive = zipfile.ZipFile(_Window(raw, end))
        members = _members(raw, archive, offset, end)
        if "data.pkl" not in members:
            raise ValueError("no data.pkl: not a torch.save zip archive")
        if "byteorder" in members and archive.read(members["byteorder"][0]).strip() not in (b"little", b""):
            raise ValueError("big-endian storages are not supported")
        pickled = archive.read(members["data.pkl"][0])
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
    whatever the number of tensors; tensor bytes are fetched later, per piece (`mapped_span`), so headers
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
