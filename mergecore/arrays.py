"""Arrays as the merge sees them: numpy arrays, dtypes named the torch way ("bfloat16").

The FSDP path never imports torch (its import alone costs ~2 s per process); bfloat16 comes
from ml_dtypes. Readers that work in torch (Megatron's transforms) hand over torch tensors,
which `to_numpy` turns into views without copying.

>>> to_numpy(np.ones(2, np.float32)).astype(numpy_dtype("bfloat16")).dtype.name
'bfloat16'
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# dtype name (torch spelling) -> (numpy dtype, safetensors name)
_DTYPES = {
    "float64": (np.dtype(np.float64), "F64"),
    "float32": (np.dtype(np.float32), "F32"),
    "float16": (np.dtype(np.float16), "F16"),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
    "int64": (np.dtype(np.int64), "I64"),
    "int32": (np.dtype(np.int32), "I32"),
    "int16": (np.dtype(np.int16), "I16"),
    "int8": (np.dtype(np.int8), "I8"),
    "uint8": (np.dtype(np.uint8), "U8"),
    "bool": (np.dtype(np.bool_), "BOOL"),
}
FLOATING = {"float64", "float32", "float16", "bfloat16"}
_BY_NUMPY = {dtype: name for name, (dtype, _) in _DTYPES.items()}
_BY_SAFETENSORS = {st: name for name, (_, st) in _DTYPES.items()}
_SAME_SIZE_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_EQUAL_BYTES = 16 << 20  # bytes of each array compared at a time


def numpy_dtype(name: str) -> np.dtype:
    """`"bfloat16"` -> the numpy dtype that holds it."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported (supported: {', '.join(_DTYPES)})") from None


def safetensors_dtype(name: str) -> str:
    """`"bfloat16"` -> `"BF16"`, the spelling of safetensors headers."""
    numpy_dtype(name)  # unknown names raise
    return _DTYPES[name][1]


def from_safetensors_dtype(code: str) -> str:
    return _BY_SAFETENSORS[code]


def element_size(name: str) -> int:
    """Bytes per element: `element_size("bfloat16") == 2`."""
    return numpy_dtype(name).itemsize


def dtype_of(array) -> str:
    """The torch-style dtype name of a numpy array or torch tensor."""
    if isinstance(array, np.ndarray):
        return _BY_NUMPY[array.dtype]
    return str(array.dtype).removeprefix("torch.")


def to_numpy(array) -> np.ndarray:
    """A numpy view of a numpy array or a CPU torch tensor (bfloat16 included), without copying."""
    if isinstance(array, np.ndarray):
        return array
    import torch

    tensor = array.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array):
    """A torch tensor sharing memory with a numpy array (read-only arrays are copied)."""
    import torch

    if not isinstance(array, np.ndarray):
        return array
    if not array.flags.writeable:
        array = array.copy()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def cast(array, name: str) -> np.ndarray:
    """`array` in dtype `name` (round to nearest even, like torch); no copy when it already is."""
    return to_numpy(array).astype(numpy_dtype(name), copy=False)


def bitwise_equal(a, b) -> bool:
    """Equal shapes, dtypes and bytes (NaN payloads and signed zeros included)."""
    a, b = to_numpy(a), to_numpy(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fV":  # floats, and ml_dtypes' bfloat16 (kind V): compare the bits
        bits = _SAME_SIZE_UINT[a.dtype.itemsize]
        a, b = a.view(bits), b.view(bits)
    # row blocks: the comparison's temporary stays small however large the arrays
    rows = max(1, _EQUAL_BYTES // max(1, a[:1].nbytes)) if a.ndim else 1
    return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows)) if a.ndim else \
        bool(np.array_equal(a, b))


# A float is non-finite when its exponent bits are all ones: as a signed integer at least
# `exponent` (positive), as an unsigned one at least `sign | exponent` (negative).
_ALL_ONES_EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F80_0000, "float64": 0x7FF0_0000_0000_0000}
_SAME_SIZE_INT = {2: np.int16, 4: np.int32, 8: np.int64}
_SCAN_BYTES = 512 << 10  # a chunk read twice stays in L2


def nonfinite_counts(array) -> dict[str, int] | None:
    """Counts of NaN, +Inf and -Inf in a floating array, or None when every value is finite (or it is not floating).

    The common all-finite case costs two integer max-reductions per 512 KiB chunk of the raw bits
    (no temporaries, no float arithmetic: ~1/3 of writing the array out); values are counted only
    when a chunk fails.

    >>> nonfinite_counts(np.array([1.0, np.nan, -np.inf], np.float32))
    {'nan': 1, '+inf': 0, '-inf': 1}
    """
    array = to_numpy(array)
    name = _BY_NUMPY.get(array.dtype)
    if name not in _ALL_ONES_EXPONENT or not array.size:
        return None
    flat = np.ascontiguousarray(array).reshape(-1)
    unsigned, signed = flat.view(_SAME_SIZE_UINT[flat.itemsize]), flat.view(_SAME_SIZE_INT[flat.itemsize])
    exponent = _ALL_ONES_EXPONENT[name]
    negative = (1 << (8 * flat.itemsize - 1)) | exponent
    step = _SCAN_BYTES // flat.itemsize
    for start in range(0, flat.size, step):
        if unsigned[start:start + step].max() >= negative or signed[start:start + step].max() >= exponent:
            return _count_nonfinite(flat)
    return None


def _count_nonfinite(array: np.ndarray) -> dict[str, int]:
    counts = {"nan": 0, "+inf": 0, "-inf": 0}
    flat = array.reshape(-1)
    step = _SCAN_BYTES // 2
    for start in range(0, flat.size, step):
        values = flat[start:start + step].astype(np.float64)  # exact for every float dtype we write
        counts["nan"] += int(np.count_nonzero(np.isnan(values)))
        counts["+inf"] += int(np.count_nonzero(np.isposinf(values)))
        counts["-inf"] += int(np.count_nonzero(np.isneginf(values)))
    return counts
