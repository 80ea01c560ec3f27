"""Load torch files that carry more than tensors (Megatron's `model.pt`) without trusting the pickle.

`torch.load(weights_only=True)` refuses any class it does not know, and plain unpickling would run
arbitrary code. This unpickler resolves only an allow-list of globals; a format extends it with
inert `Record`s that keep the pickled fields. Tensors are rebuilt by torch's own storage machinery
(mmap). FSDP rank files need no torch at all: see torchfile.py.
"""

from __future__ import annotations

import collections
import pickle
import types
from collections.abc import Callable

import torch

from .torchfile import Record

__all__ = ["Record", "RestrictedUnpickler", "load_restricted", "load_untrusted"]


def _rebuild_from_type(func, new_type, args, state):
    if new_type in (torch.Tensor, torch.nn.Parameter):
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)
    raise pickle.UnpicklingError(f"refusing to rebuild tensor subclass {new_type!r}")


_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
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

    >>> state = load_restricted("model.pt")   # doctest: +SKIP
    >>> state["lm_head.weight"].shape         # doctest: +SKIP
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
