"""Read `torch.save` files without torch: tensors come back as read-only numpy views of the mmapped file.

A torch.save file is an uncompressed zip. `<archive>/data.pkl` pickles the object tree, naming each
tensor storage by a key whose raw little-endian bytes are the member `<archive>/data/<key>`. We
unpickle with an allow-list: storages become numpy views of the file, tensors strided views of
those, and classes that only describe a layout (DTensor's spec and device mesh, ShardedTensor's
metadata, placements) become inert records of their pickled fields. Nothing else is imported or
called, so a file cannot run code; and since records keep whatever fields were pickled, files from
different torch versions read alike (their DeviceMesh internals differ: see `MeshRecord`).

>>> state = load("model_world_size_2_rank_0.pt", "rank 0")   # doctest: +SKIP
>>> state["lm_head.weight"].placements, state["lm_head.weight"].local.shape  # doctest: +SKIP
((Shard(dim=0),), (500, 64))
"""

from __future__ import annotations

import collections
import io
import itertools
import mmap
import pickle
import struct
import zipfile

import numpy as np

from ..arrays import numpy_dtype
from ..errors import CheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "UntypedStorage": "uint8",
}
_TORCH_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


class Record:
    """Inert stand-in for an allow-listed class: its constructor arguments and pickled state, as attributes."""

    def __new__(cls, *args, **kwargs):
        record = object.__new__(cls)
        record.args = args
        return record

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)  # (dict, slots) form
        for part in parts:
            if isinstance(part, dict):
                self.__dict__.update(part)
            elif part is not None:
                self.state = part

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items() if k != 'args')})"


class _Placement(Record):
    """How a DTensor is laid out along one mesh dimension; the methods fsdp.py asks, as torch's have."""

    def is_shard(self) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False


class Shard(_Placement):
    def is_shard(self) -> bool:
        return True

    def __str__(self):  # torch's short form, as in layouts: "S(0)"
        return f"S({self.dim})"

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class Replicate(_Placement):
    def is_replicate(self) -> bool:
        return True

    def __str__(self):
        return "R"

    def __repr__(self):
        return "Replicate()"


class OtherPlacement(_Placement):
    """Partial, _StridedShard (FSDP combined with tensor parallelism): not merged by this reader."""

    def __str__(self):
        return type(self).__name__


class MeshRecord(Record):
    """A pickled DeviceMesh. Older torch pickles the rank grid (`mesh`); 2.13 pickles a flat `_rank_map`
    plus a `_layout` of (size, stride) per mesh dimension, which `mesh` turns back into the grid."""

    @property
    def mesh(self) -> np.ndarray:
        if "mesh" in self.__dict__:
            return np.asarray(self.__dict__["mesh"])
        rank_map = np.asarray(self._rank_map).reshape(-1)
        # Each mesh dimension is a flat layout: its coordinate enumerates the (size, stride) modes
        # lexicographically (a size-1 dimension has no modes) and picks rank_map[sum(coordinate * stride)].
        axes = [np.array([sum(c * t for c, t in zip(coordinate, _tuple(axis.stride)))
                          for coordinate in itertools.product(*(range(n) for n in _tuple(axis.shape)))])
                for axis in self._layout.axes]
        offsets = sum(np.reshape(a, [-1 if d == i else 1 for d in range(len(axes))]) for i, a in enumerate(axes))
        offsets = np.asarray(offsets).reshape([len(a) for a in axes])
        where = getattr(self, "_coordinate_on_dim", None)
        if getattr(self, "_rank", None) is not None and where:  # a sub-mesh: the slice that holds this rank
            offsets = offsets + int(np.flatnonzero(rank_map == self._rank)[0]) - int(offsets[tuple(where)])
        return rank_map[offsets]

    @property
    def mesh_dim_names(self):
        return getattr(self, "_mesh_dim_names", None) or getattr(self, "mesh_dim_names", None)


def _tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class DTensorRecord(Record):
    """A pickled DTensor: global `shape` and `dtype`, this rank's `local` array, `placements`, `device_mesh`."""

    @property
    def local(self) -> np.ndarray:
        return self._local_tensor

    @property
    def placements(self) -> tuple:
        return tuple(self._spec.placements)

    @property
    def device_mesh(self) -> MeshRecord:
        return self._spec.mesh


class ShardedTensorRecord(Record):
    """A pickled FSDP1 ShardedTensor: `local_shards` (each with `.tensor` and `.metadata`) and global `metadata`."""

    class ProcessGroupState(Record):
        pass

    def __setstate__(self, state):
        self.local_shards, self.metadata = state[0], state[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.metadata.size)

    @property
    def dtype(self) -> str:
        props = self.metadata.tensor_properties  # pickled as (dtype, layout, requires_grad, ...)
        return props.state[0] if hasattr(props, "state") else props.dtype


# Classes under torch.distributed, by name: their module moved between torch versions.
_DISTRIBUTED = {
    "DTensor": DTensorRecord, "DeviceMesh": MeshRecord, "Shard": Shard, "Replicate": Replicate,
    "Partial": OtherPlacement, "_StridedShard": OtherPlacement, "_Partial": OtherPlacement,
    "ShardedTensor": ShardedTensorRecord,
}
_DISTRIBUTED_RECORDS = ("DTensorSpec", "TensorMeta", "ShardOrderEntry", "_MeshLayout", "_FlatLayout",
                        "ShardMetadata", "ShardedTensorMetadata", "TensorProperties", "ChunkShardingSpec",
                        "_remote_device")
_sharded_tensor_shard = type("LocalShard", (Record,), {})  # sharded_tensor.shard.Shard, not the placement
_records: dict[str, type] = {}


def _distributed_class(module: str, name: str):
    if name == "Shard" and "sharded_tensor" in module:
        return _sharded_tensor_shard
    if name in _DISTRIBUTED:
        return _DISTRIBUTED[name]
    if name in _DISTRIBUTED_RECORDS:
        return _records.setdefault(name, type(name, (Record,), {}))
    return None


class _TensorClass:
    """torch.Tensor / nn.Parameter as a pickled type argument: plain tensors rebuild to arrays."""


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    size, itemsize = tuple(size), storage.dtype.itemsize
    if 0 in size:
        array = np.empty(size, storage.dtype)
    else:
        try:
            array = np.ndarray(size, storage.dtype, buffer=storage, offset=storage_offset * itemsize,
                               strides=tuple(s * itemsize for s in stride))
        except (TypeError, ValueError) as err:
            raise pickle.UnpicklingError(f"a tensor lies outside its storage ({err})") from None
    array.flags.writeable = False
    return array


def _rebuild_wrapper_subclass(cls, dtype, size, *rest):
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        raise pickle.UnpicklingError(f"refusing to rebuild a tensor subclass as {cls!r}")
    return cls()


def _rebuild_from_type(func, new_type, args, state):
    if new_type is _TensorClass:
        return func(*args)
    if new_type is ShardedTensorRecord:
        record = ShardedTensorRecord()
        record.__setstate__(state)
        return record
    if new_type is DTensorRecord:
        record = func(*args)
        record.__setstate__(state)
        record.dtype, record.shape = args[1], tuple(args[2])
        return record
    raise pickle.UnpicklingError(f"refusing to rebuild tensor subclass {getattr(new_type, '__name__', new_type)}")


def _getattr(obj, name):
    if obj is ShardedTensorRecord and name == "ProcessGroupState":
        return ShardedTensorRecord.ProcessGroupState
    raise pickle.UnpicklingError(f"refusing getattr({obj!r}, {name!r}) in a checkpoint pickle")


class _StorageType(str):
    """`torch.FloatStorage` and friends: the dtype name of a persisted storage."""


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): lambda data, *rest: data,
    ("torch._utils", "_rebuild_parameter_with_state"): lambda data, *rest: data,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch", "Size"): lambda dims=(): tuple(dims),
    ("torch", "device"): lambda *args: args[0] if args else "cpu",
    ("torch", "Tensor"): _TensorClass,
    ("torch.nn.parameter", "Parameter"): _TensorClass,
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): lambda value: value,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storage):
        super().__init__(file)
        self._storage = storage

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_DTYPES:
            return name
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module.startswith("torch.distributed") and (found := _distributed_class(module, name)):
            return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        return self._storage(str(key), str(dtype), int(numel))


def _member_offset(raw: mmap.mmap, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) member's bytes start: after its local header."""
    header = raw[info.header_offset:info.header_offset + 30]
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"bad local header for {info.filename}")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


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


def load(path: str, shown_as: str, offset: int = 0, length: int | None = None):
    """The object a `torch.save` file holds, with tensors as read-only numpy views (mmap: nothing is read yet).

    `offset`/`length` select a torch.save archive stored inside a larger file (a DCP `.distcp` item).
    Bad files raise a one-line CheckpointError naming `shown_as`.
    """
    try:
        with open(path, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        end = len(raw) if length is None else offset + length
        if end > len(raw):
            raise ValueError(f"{end - len(raw)} bytes missing at the end")
        # zipfile finds the archive from its end record; bytes before `offset` count as prepended data
        archive = zipfile.ZipFile(_Window(raw, end))
        members = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        if "data.pkl" not in members:
            raise ValueError("no data.pkl: not a torch.save zip archive")
        if "byteorder" in members and archive.read(members["byteorder"]).strip() not in (b"little", b""):
            raise ValueError("big-endian storages are not supported")
        pickled = archive.read(members["data.pkl"])
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(
            f"{shown_as}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or not a "
            "torch checkpoint: copy it again from where training saved it"
        ) from None
    storages: dict[str, np.ndarray] = {}

    def storage(key: str, dtype: str, numel: int) -> np.ndarray:
        if key not in storages:
            info = members.get(f"data/{key}")
            if info is None or info.compress_type != zipfile.ZIP_STORED:
                raise pickle.UnpicklingError(f"storage {key} is missing or compressed")
            element = numpy_dtype(dtype)
            if info.file_size < numel * element.itemsize:
                raise pickle.UnpicklingError(f"storage {key} holds {info.file_size} bytes, fewer than {numel} {dtype}")
            storages[key] = np.frombuffer(raw, element, count=numel, offset=_member_offset(raw, info))
        return storages[key]

    try:
        return _Unpickler(io.BytesIO(pickled), storage).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointError(
            f"{shown_as}: refused to unpickle ({str(err).splitlines()[0]}); ckptflow only loads tensors, never "
            "arbitrary objects"
        ) from None
