"""Untrusted pickles: one allow-listed Unpickler, and every reader's allow-list as data.

One module, long as it is, because the security boundary is kept in one place: each reader's allow-list is a table
here, one per kind of file.

Checkpoint pickles run unattended, so nothing in them is trusted. `AllowListUnpickler.find_class`
resolves a global only through an allow-list `{(module, name): value}`; anything else is refused
(`Refused`) and nothing of it is imported or called. A key's module may end in `.*` (any module
below it: torch moved its distributed classes between versions) and its name may be `*` (any name);
the most specific key wins. A value is returned as it is, or, when it is a `Resolver`, made per
file from (unpickler, module, name): that is how sizes are bounded by the file's real size and
how unknown classes of a trusted family become inert `Record`s.

The allow-lists, one per kind of file:

- `TORCH_FILE` (no torch import): torch.save archives read by `torchfile` (FSDP rank files, DCP
  `.distcp` items). Storages are numpy views of the mmapped file, tensors strided views inside
  their own storage, DTensor/ShardedTensor layout classes inert records.
- `megatron_file()`: Megatron `model.pt` / dist_ckpt `common.pt`, also read by `torchfile` (no torch
  import); tensors are numpy views as above, dtypes their names, the `args` Namespace, enums and
  TransformerEngine extra state inert records.
- `DCP_METADATA`: a DCP `.metadata`: torch's metadata dataclasses as inert records, dtypes as names, sizes as
  bounded tuples, pure paths (no torch import).

Every declared size is bounded before anything is allocated: a storage lies inside its own zip
member (`storage_view`), a tensor's strided view inside its storage and its element count below the
file's size (`bounded_view`), a `torch.Size` likewise (`max_elements`).

>>> import io, pickle
>>> AllowListUnpickler(io.BytesIO(pickle.dumps(print)), {}).load()
Traceback (most recent call last):
...
mergecore.formats.untrusted.Refused: global builtins.print is not allowed in a checkpoint
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import math
import pickle
from collections.abc import Callable, Mapping

import numpy as np

__all__ = ["AllowListUnpickler", "DCP_METADATA", "DCP_RECORDS", "Record", "Refused", "Resolver", "TORCH_FILE",
           "megatron_file"]


class Refused(pickle.UnpicklingError):
    """The pickle asks for something outside the allow-list or its bounds; the file is refused."""


class Resolver:
    """An allow-list value made per file: `make(unpickler, module, name)` returns what the global is."""

    def __init__(self, make: Callable[[AllowListUnpickler, str, str], object]):
        self.make = make


class AllowListUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves globals only through `allowed`.

    `storage(key, dtype, numel)` answers torch.save's persistent ids (`("storage", type, key,
    location, numel)`); without it persistent ids are refused. `file_bytes`, the size of the file
    the pickle came from, bounds every declared element count.
    """

    def __init__(self, file, allowed: Mapping[tuple[str, str], object], *, storage=None, file_bytes: int = 0,
                 what: str = "a checkpoint"):
        super().__init__(file)
        self.allowed, self.storage, self.file_bytes, self.what = allowed, storage, file_bytes, what
        self._made: dict[tuple[str, str], object] = {}

    def load(self):
        try:
            return super().load()
        finally:
            # the resolvers made for this file close over the unpickler, and the memo holds them: left in
            # place, that cycle keeps every object of the file alive until a cycle collection finds it
            self._made.clear()
            self.memo.clear()

    def find_class(self, module: str, name: str):
        if (module, name) not in self._made:
            value = _lookup(self.allowed, module, name)
            if value is None:
                raise Refused(f"global {module}.{name} is not allowed in {self.what}")
            self._made[(module, name)] = value.make(self, module, name) if isinstance(value, Resolver) else value
        return self._made[(module, name)]

    def persistent_load(self, pid):
        if not (self.storage and isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], StorageType) and isinstance(pid[2], str)):
            raise Refused(f"unexpected persistent id {str(pid)[:80]}")
        _, dtype, key, _location, numel = pid
        if type(numel) is not int or numel < 0:
            raise Refused(f"storage {key} declares {numel!r} elements")
        return self.storage(key, str(dtype), numel)

    def max_elements(self, shape, what: str, per_byte: int = 1) -> tuple[int, ...]:
        """`shape` as a tuple of ints, refused when negative or holding more than `per_byte` elements
        per byte of the file (every element of a local tensor takes at least a byte)."""
        dims = tuple(shape)
        if not all(type(d) is int and d >= 0 for d in dims):
            raise Refused(f"{what} {dims} has a negative or non-integer size")
        if math.prod(dims) > max(self.file_bytes, 1) * per_byte:
            raise Refused(f"{what} {dims} declares more elements than the file's {self.file_bytes} bytes"
                          + (f" times {per_byte} ranks" if per_byte > 1 else ""))
        return dims


def _lookup(allowed: Mapping, module: str, name: str):
    """The most specific allow-list value for `module.name`, or None."""
    parts = module.split(".")
    modules = [module] + [".".join(parts[:i]) + ".*" for i in range(len(parts), 0, -1)]
    for candidate in itertools.chain(((m, name) for m in modules), ((m, "*") for m in modules)):
        if candidate in allowed:
            return allowed[candidate]
    return None


# ---- inert records -----------------------------------------------------------------------------

class Record:
    """Inert stand-in for an allow-listed class: its constructor arguments and pickled state, as attributes.

    Only plain field names are kept: dunders (`__class__`, `__dict__`...) and names of the record's
    own methods are refused, so a pickle cannot change what a record is or does.
    """

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
                # a rank file restores the same few fields on thousands of records: check each name once per class
                checked = _CHECKED_FIELDS.setdefault(type(self), set())
                if not checked.issuperset(part):
                    for key in part:
                        self._check_field(key)
                        checked.add(str(key))
                self.__dict__.update(part)
            elif part is not None:
                self.state = part

    @classmethod
    def _check_field(cls, key) -> None:
        if not (isinstance(key, str) and key.isidentifier() and not key.startswith("__")):
            raise Refused(f"{cls.__name__} state has a field named {str(key)[:40]!r}; only plain names are allowed")
        if callable(getattr(cls, key, None)):
            raise Refused(f"{cls.__name__} state would replace its method {key}")

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items() if k != 'args')})"


_CHECKED_FIELDS: dict[type, set[str]] = {}  # Record class -> field names `_check_field` accepted


def inert(prefix: str = "inert.") -> Resolver:
    """A Resolver giving one Record subclass per (module, name): holds fields, never imports or calls."""
    made: dict[tuple[str, str], type] = {}

    def make(_unpickler, module: str, name: str) -> type:
        return made.setdefault((module, name), type(name, (Record,), {"__module__": prefix + module}))

    return Resolver(make)


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
    plus a `_layout` of (size, stride) per mesh dimension, which `mesh` turns back into the grid.

    Every DTensor of a rank file shares one pickled mesh, and a merge asks for its grid once per
    tensor: the grid is built once per record and kept (read-only) under a dunder key, which a
    pickle cannot set (`Record._check_field`)."""

    @property
    def mesh(self) -> np.ndarray:
        grid = self.__dict__.get(_GRID)
        if grid is None:
            grid = np.array(self._rank_grid())  # a copy: the pickled rank map itself is never aliased
            grid.flags.writeable = False
            self.__dict__[_GRID] = grid
        return grid

    def _rank_grid(self) -> np.ndarray:
        if "mesh" in self.__dict__:
            return np.asarray(self.__dict__["mesh"])
        rank_map = np.asarray(self._rank_map).reshape(-1)
        # The layout's sizes are claims; the grid picks distinct ranks of the pickled rank map, so it holds at
        # most as many: bounded so before any offset is built (`formats.claims`)
        claimed = math.prod(math.prod(_tuple(axis.shape)) for axis in self._layout.axes)
        if claimed > rank_map.size:
            raise ValueError(f"its layout claims {claimed} ranks but its rank map holds {rank_map.size}")
        # Each mesh dimension is a flat layout: its coordinate enumerates the (size, stride) modes
        # lexicographically (a size-1 dimension has no modes) and picks rank_map[sum(coordinate * stride)].
        axes = [_flat_offsets(_tuple(axis.shape), _tuple(axis.stride)) for axis in self._layout.axes]
        offsets = np.zeros([len(a) for a in axes], dtype=np.int64)
        for i, a in enumerate(axes):
            offsets = offsets + np.reshape(a, [-1 if d == i else 1 for d in range(len(axes))])
        where = getattr(self, "_coordinate_on_dim", None)
        if getattr(self, "_rank", None) is not None and where:  # a sub-mesh: the slice that holds this rank
            offsets = offsets + int(np.flatnonzero(rank_map == self._rank)[0]) - int(offsets[tuple(where)])
        return rank_map[offsets]

    @property
    def mesh_dim_names(self):
        return getattr(self, "_mesh_dim_names", None) or getattr(self, "mesh_dim_names", None)


_GRID = "__rank_grid"


def _flat_offsets(shape: tuple, stride: tuple) -> np.ndarray:
    """`sum(coordinate * stride)` for every coordinate of `shape`, in lexicographic order."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, step in zip(shape, stride):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * step).reshape(-1)
    return offsets


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


LocalShard = type("LocalShard", (Record,), {})  # sharded_tensor.shard.Shard, not the placement


# ---- storages and tensors (numpy, no torch) --------------------------------------------------

STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "UntypedStorage": "uint8",
}
TORCH_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class StorageType(str):
    """`torch.FloatStorage` and friends: the dtype name of a persisted storage."""


class TensorClass:
    """torch.Tensor / nn.Parameter as a pickled type argument: plain tensors rebuild to arrays. It
    takes no arguments, so a pickle cannot construct (allocate) a tensor with it."""


def bounded_view(unpickler: AllowListUnpickler, storage: np.ndarray, storage_offset, size, stride) -> np.ndarray:
    """The read-only strided view `storage[offset:]` with `size`/`stride`, refused unless every element
    it can reach lies inside `storage` and it declares no more elements than the file has bytes."""
    size = unpickler.max_elements(size, "tensor size")
    stride = tuple(stride)
    if type(storage_offset) is not int or not all(type(s) is int for s in stride) or len(stride) != len(size):
        raise Refused(f"tensor offset {storage_offset!r} / stride {stride} do not describe a view of {size}")
    if storage_offset < 0 or any(s < 0 for s in stride):  # torch never saves negative strides
        raise Refused(f"tensor offset {storage_offset} / stride {stride} are negative")
    if 0 in size:
        array = np.empty(size, storage.dtype)
    else:
        last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.size:
            raise Refused(f"a tensor of size {size}, stride {stride} at offset {storage_offset} reaches element "
                          f"{last} of a storage of {storage.size}")
        itemsize = storage.dtype.itemsize
        array = np.ndarray(size, storage.dtype, buffer=storage, offset=storage_offset * itemsize,
                           strides=tuple(s * itemsize for s in stride))
    array.flags.writeable = False
    return array


def _rebuild_tensor(unpickler, _module, _name):
    def rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
        if not isinstance(storage, np.ndarray):
            raise Refused(f"a tensor's storage is a {type(storage).__name__}")
        return bounded_view(unpickler, storage, storage_offset, size, stride)

    return rebuild


def _rebuild_wrapper_subclass(cls, dtype, size, *rest):
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        raise Refused(f"refusing to rebuild a tensor subclass as {cls!r}")
    return cls()


def _rebuild_from_type(unpickler, _module, _name):
    """Plain tensors, and DTensor/ShardedTensor records (a DTensor's global shape bounded like `torch.Size`)."""
    def rebuild(func, new_type, args, state):
        if new_type is TensorClass:
            return func(*args)
        if new_type is ShardedTensorRecord:
            record = ShardedTensorRecord()
            record.__setstate__(state)
            return record
        if new_type is DTensorRecord:
            record = func(*args)
            record.__setstate__(state)
            record.dtype = args[1]
            record.shape = unpickler.max_elements(args[2], "DTensor shape", per_byte=MAX_RANKS)
            return record
        raise Refused(f"refusing to rebuild tensor subclass {getattr(new_type, '__name__', new_type)}")

    return rebuild


def _getattr(obj, name):
    if obj is ShardedTensorRecord and name == "ProcessGroupState":
        return ShardedTensorRecord.ProcessGroupState
    raise Refused(f"refusing getattr({obj!r}, {name!r}) in a checkpoint pickle")


def _size(unpickler, _module, _name):
    return lambda dims=(): unpickler.max_elements(dims, "torch.Size")


MAX_RANKS = 2 ** 16


def _global_size(unpickler, _module, _name):
    """A DTensor's global shape spans every rank's shard, so it may exceed one rank file: at most
    MAX_RANKS times its bytes here; fsdp.py checks that the ranks' shards cover it exactly."""
    return lambda dims=(): unpickler.max_elements(dims, "torch.Size", per_byte=MAX_RANKS)


_LAYOUT_RECORDS = ("DTensorSpec", "TensorMeta", "ShardOrderEntry", "_MeshLayout", "_FlatLayout", "ShardMetadata",
                   "ShardedTensorMetadata", "TensorProperties", "ChunkShardingSpec", "_remote_device")

# Plain tensors, no torch import: what every torch.save reader allows.
_TENSORS: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): Resolver(_rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): lambda data, *rest: data,
    ("torch._utils", "_rebuild_parameter_with_state"): lambda data, *rest: data,
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch", "device"): lambda *args: args[0] if args else "cpu",
    ("torch", "Tensor"): TensorClass,
    ("torch.nn.parameter", "Parameter"): TensorClass,
    **{("torch", name): StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}

# FSDP rank files and DCP .distcp items: plain tensors, and DTensor/ShardedTensor layouts as records.
TORCH_FILE: dict[tuple[str, str], object] = {
    **_TENSORS,
    **{("torch", name): name for name in TORCH_DTYPES},
    ("torch", "Size"): Resolver(_global_size),
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): Resolver(_rebuild_from_type),
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): lambda value: value,
    # classes under torch.distributed, by name: their module moved between torch versions
    ("torch.distributed.*", "DTensor"): DTensorRecord,
    ("torch.distributed.*", "DeviceMesh"): MeshRecord,
    ("torch.distributed.*", "Shard"): Shard,
    ("torch.distributed._shard.sharded_tensor.*", "Shard"): LocalShard,
    ("torch.distributed.*", "Replicate"): Replicate,
    **{("torch.distributed.*", name): OtherPlacement for name in ("Partial", "_StridedShard", "_Partial")},
    ("torch.distributed.*", "ShardedTensor"): ShardedTensorRecord,
    **{("torch.distributed.*", name): type(name, (Record,), {}) for name in _LAYOUT_RECORDS},
}


# ---- Megatron model.pt / common.pt (torch tensors over the mapped file) ----------------------

def _latin1(text, encoding="latin1"):
    """`_codecs.encode` as protocol-2 pickles use it for bytes; other codecs could expand data."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Refused(f"_codecs.encode with {encoding!r} is not allowed (only latin1, for bytes)")
    return text.encode("latin1")


# every torch dtype a Megatron `args` Namespace may name (params_dtype, fp8 formats...): kept as its name
_ALL_TORCH_DTYPES = (*TORCH_DTYPES, "half", "float", "double", "bfloat", "long", "int", "short", "cfloat", "cdouble",
                     "uint16", "uint32", "uint64", "complex32", "complex64", "complex128", "chalf", "quint8", "qint8",
                     "qint32", "quint4x2", "quint2x4", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                     "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16")


@functools.cache
def megatron_file() -> dict[tuple[str, str], object]:
    """Allow-list for Megatron `model.pt`/`common.pt` (no torch import): `TORCH_FILE`'s plain tensors as
    read-only numpy views of the mapped file, torch dtypes as their names, sizes as bounded tuples, and
    inert records for what Megatron keeps beside tensors."""

    def rebuild_from_type(func, new_type, args, state):
        if new_type is TensorClass:
            return func(*args)
        raise Refused(f"refusing to rebuild tensor subclass {getattr(new_type, '__name__', new_type)}")

    return {
        **_TENSORS,
        ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
        ("torch", "Size"): Resolver(_size),
        **{("torch", name): name for name in _ALL_TORCH_DTYPES},
        ("_codecs", "encode"): _latin1,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        # the `args` Namespace, enums, TransformerEngine's BytesIO extra state: fields only
        ("argparse", "Namespace"): inert(),
        ("types", "SimpleNamespace"): inert(),
        ("_io", "BytesIO"): inert(),
        ("io", "BytesIO"): inert(),
        ("megatron.*", "*"): inert(),
        ("transformer_engine.*", "*"): inert(),
        ("numpy.*", "*"): inert(),
    }


# ---- DCP .metadata ----------------------------------------------------------------------------

def check_plain_fields(root, what: str) -> None:
    """Refuse objects in `root` (a loaded pickle of real classes) whose pickled state set dunder or
    non-identifier attributes: pickle's BUILD writes them into `__dict__` unchecked."""
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        # enum members come from their class by value (pickle never BUILDs them) and keep dunders of their own
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), enum.Enum, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            for key, value in vars(obj).items():
                if not (isinstance(key, str) and key.isidentifier() and not key.startswith("__")):
                    raise Refused(f"{type(obj).__name__} in {what} has a field named {str(key)[:40]!r}")
                todo.append(value)


# ---- DCP .metadata as records (no torch import) ------------------------------------------------

class TensorPropertiesRecord(Record):
    """DCP `TensorProperties`; torch pickles it as the tuple (dtype, layout, requires_grad, memory format,
    pin_memory), older versions as fields. `dtype` is a name ("bfloat16")."""

    @property
    def dtype(self) -> str:
        return self.state[0] if isinstance(getattr(self, "state", None), tuple) and self.state else self.__dict__.get("dtype")


def _dcp_record(name: str, **defaults) -> type:
    """A record class for a DCP dataclass; `defaults` are the fields torch leaves out when they are None."""
    return type(name, (Record,), {"__module__": "dcp", **defaults})


# The classes the dist_ckpt reader (formats.megatron.dcp_metadata and .dist) checks a loaded `.metadata` against, by
# their torch names.
DCP_RECORDS: dict[str, type] = {
    "Metadata": _dcp_record("Metadata", planner_data=None, storage_meta=None, version=None),
    "TensorStorageMetadata": _dcp_record("TensorStorageMetadata"),
    "BytesStorageMetadata": _dcp_record("BytesStorageMetadata"),
    "ChunkStorageMetadata": _dcp_record("ChunkStorageMetadata"),
    "TensorProperties": TensorPropertiesRecord,
    "MetadataIndex": _dcp_record("MetadataIndex", offset=None, index=None),
    "StorageMeta": _dcp_record("StorageMeta"),
    "_StorageInfo": _dcp_record("_StorageInfo", transform_descriptors=None),
}
# every torch dtype a DCP save may name, as its name
_DCP_DTYPE_NAMES = TORCH_DTYPES + ("uint16", "uint32", "uint64", "complex32", "complex64", "complex128", "float8_e4m3fn",
                                   "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "qint8",
                                   "quint8", "qint32", "half", "float", "double", "long", "int", "short", "cfloat")


def _dcp_size(dims=()) -> tuple[int, ...]:
    dims = tuple(dims)
    if not all(type(d) is int and 0 <= d < 2 ** 63 for d in dims):
        raise Refused(f"torch.Size {dims} has a negative or non-integer size")
    return dims  # bounded by the data files' sizes once loaded: see formats.megatron.dcp_metadata


def _dcp_metadata_records() -> dict[tuple[str, str], object]:
    import pathlib

    allowed: dict[tuple[str, str], object] = {
        **{("torch.distributed.checkpoint.metadata", name): DCP_RECORDS[name]
           for name in DCP_RECORDS if name != "_StorageInfo"},
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): inert()
        .make(None, "torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DCP_RECORDS["_StorageInfo"],
        # megatron-core keeps its cached save plan in `planner_data`: plain dataclasses and enums
        **{("torch.distributed.checkpoint.planner", name): _dcp_record(name)
           for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
        ("torch", "Size"): _dcp_size,
        ("torch.serialization", "_get_layout"): lambda name: name,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        **{("torch", name): name for name in _DCP_DTYPE_NAMES},
        **{("torch", name): name for name in ("strided", "sparse_coo", "sparse_csr", "_mkldnn")},  # layouts
    }
    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id: kept as a pure path, never opened
        for name in ("PosixPath", "PurePosixPath"):
            allowed[(module, name)] = pathlib.PurePosixPath
        for name in ("WindowsPath", "PureWindowsPath"):
            allowed[(module, name)] = pathlib.PureWindowsPath
    return allowed


# A DCP `.metadata` without torch: its dataclasses as records, dtypes as names, sizes as tuples.
DCP_METADATA: dict[tuple[str, str], object] = _dcp_metadata_records()
