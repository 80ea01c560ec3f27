"""Load FSDP1 `ShardedTensor` rank files without a process group and without trusting the pickle.

`torch.load(weights_only=True)` refuses ShardedTensor, and plain unpickling would both run
arbitrary code and call ShardedTensor.__setstate__, which needs the saving rank's process group.
This unpickler resolves only an allow-list of globals. The ShardedTensor classes resolve to inert
records that keep the pickled fields; tensors are rebuilt by torch's own storage machinery (mmap).
"""

from __future__ import annotations

import collections
import pickle
import types
from collections.abc import Callable

import torch


class Record:
    """Inert stand-in for an allow-listed class: holds the pickled state as attributes."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = state[1]  # (dict, slots) form
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class ShardedTensorRecord(Record):
    """What a pickled ShardedTensor becomes: `local_shards` and global `metadata`."""

    class ProcessGroupState(Record):
        pass

    def __setstate__(self, state):
        self.local_shards, self.metadata = state[0], state[1]

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.metadata.size)

    @property
    def dtype(self) -> torch.dtype:
        props = self.metadata.tensor_properties  # pickled as (dtype, layout, requires_grad, ...)
        return props.state[0] if hasattr(props, "state") else props.dtype


def _records(*qualnames: str) -> dict[tuple[str, str], type]:
    table = {}
    for qualname in qualnames:
        module, name = qualname.rsplit(".", 1)
        table[(module, name)] = type(name, (Record,), {})
    return table


def _rebuild_from_type(func, new_type, args, state):
    if new_type is ShardedTensorRecord:
        record = ShardedTensorRecord()
        record.__setstate__(state)
        return record
    if new_type in (torch.Tensor, torch.nn.Parameter):
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)
    raise pickle.UnpicklingError(f"refusing to rebuild tensor subclass {new_type!r}")


def _getattr(obj, name):
    if obj is ShardedTensorRecord and name == "ProcessGroupState":
        return ShardedTensorRecord.ProcessGroupState
    raise pickle.UnpicklingError(f"refusing getattr({obj!r}, {name!r}) in a checkpoint pickle")


_ST = "torch.distributed._shard"
_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): lambda *args, **kwargs: None,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,
    (f"{_ST}.sharded_tensor.api", "ShardedTensor"): ShardedTensorRecord,
    (f"{_ST}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): lambda value: value,
    **_records(
        f"{_ST}.sharded_tensor.shard.Shard",
        f"{_ST}.metadata.ShardMetadata",
        f"{_ST}.sharded_tensor.metadata.ShardedTensorMetadata",
        f"{_ST}.sharded_tensor.metadata.TensorProperties",
        f"{_ST}.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
    ),
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint")


# torch.load takes a "pickle module": anything with an Unpickler (and load) attribute.
restricted_pickle = types.SimpleNamespace(
    Unpickler=RestrictedUnpickler,
    load=lambda f, **kw: RestrictedUnpickler(f, **kw).load(),
    __name__="restricted_pickle",
)


def load_restricted(path: str) -> dict:
    """`torch.load` with the allow-list above; tensors stay mmapped.

    >>> state = load_restricted("model_world_size_2_rank_0.pt")  # doctest: +SKIP
    >>> state["lm_head.weight"].local_shards[0].tensor.shape      # doctest: +SKIP
    """
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=restricted_pickle)


def load_untrusted(path: str, shown_as: str, restricted: Callable[[str], object] = load_restricted):
    """A torch file with tensors mmapped: `weights_only` first, then `restricted` (an allow-listed
    unpickler) for files that carry more than plain tensors. Never unrestricted unpickling.

    Bad files become one-line CheckpointErrors naming `shown_as`.
    """
    from ..errors import CheckpointError

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        pass
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{shown_as}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or not a "
            "torch checkpoint: copy it again from where training saved it"
        ) from None
    try:
        return restricted(path)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{shown_as}: refused to unpickle ({str(err).splitlines()[0]}); ckptflow only loads tensors, never "
            "arbitrary objects"
        ) from None
