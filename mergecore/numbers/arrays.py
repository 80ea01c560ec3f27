"""Arrays as the merge sees them: numpy arrays, dtypes named the torch way ("bfloat16").

The merge path imports neither torch (~2 s per process) nor ml_dtypes (0.7.0: ~1 s): a bfloat16
array is held as its raw bits, a `uint16` array (uint16 is no checkpoint dtype we read, so the
bits are unambiguous), and `cast` rounds to bfloat16 and float16 in plain numpy, bit for bit as
torch does. Arithmetic on bfloat16 goes through `cast(array, "float32")`, which is exact.
Readers that work in torch (Megatron's transforms) hand over torch tensors, which `to_numpy`
turns into views without copying.

>>> cast(np.array([1.0, 1.00390625], np.float32), "bfloat16")  # the tie rounds to even
array([16256, 16256], dtype=uint16)
>>> dtype_of(_), cast(_, "float32")
('bfloat16', array([1., 1.], dtype=float32))
"""

from __future__ import annotations

import numpy as np

# dtype name (torch spelling) -> (numpy dtype holding it, safetensors name)
_DTYPES = {
    "float64": (np.dtype(np.float64), "F64"),
    "float32": (np.dtype(np.float32), "F32"),
    "float16": (np.dtype(np.float16), "F16"),
    "bfloat16": (np.dtype(np.uint16), "BF16"),  # the bits
    "int64": (np.dtype(np.int64), "I64"),
    "int32": (np.dtype(np.int32), "I32"),
    "int16": (np.dtype(np.int16), "I16"),
    "int8": (np.dtype(np.int8), "I8"),
    "uint8": (np.dtype(np.uint8), "U8"),
    "bool": (np.dtype(np.bool_), "BOOL"),
    "float8_e4m3fn": (np.dtype(np.uint8), "F8_E4M3"),  # the bits; written by --quantize fp8-block only
}
FLOATING = {"float64", "float32", "float16", "bfloat16"}
_BY_NUMPY = {dtype: name for name, (dtype, _) in _DTYPES.items() if name != "float8_e4m3fn"}  # uint8 stays uint8
_BY_SAFETENSORS = {st: name for name, (_, st) in _DTYPES.items()}
_SAME_SIZE_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_EQUAL_BYTES = 16 << 20  # bytes of each array compared at a time


def numpy_dtype(name: str) -> np.dtype:
    """`"bfloat16"` -> the numpy dtype that holds it (`uint16`: its bits)."""
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
        return _BY_NUMPY[to_numpy(array).dtype]
    return str(array.dtype).removeprefix("torch.")


def to_numpy(array) -> np.ndarray:
    """A numpy view of a numpy array or a CPU torch tensor, without copying; bfloat16 (torch's, or
    an ml_dtypes array a caller made) becomes its uint16 bits."""
    if isinstance(array, np.ndarray):
        if array.dtype in _BY_NUMPY:  # a dict lookup: `dtype.name` is Python code, ~7 µs a call per piece
            return array
        # ml_dtypes' bfloat16, recognised by name so that ml_dtypes is never imported here
        return array.view(np.uint16) if array.dtype.name == "bfloat16" else array
    import torch

    tensor = array.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_torch(array):
    """A torch tensor sharing memory with a numpy array (read-only arrays are copied)."""
    import torch

    if not isinstance(array, np.ndarray):
        return array
    array = to_numpy(array)
    if not array.flags.writeable:
        array = array.copy()
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


_CAST_BLOCK = 1 << 16  # elements per step: a step's float32 input and its uint32 scratch (256 KiB each) stay in L2; 2.05 s -> 1.75 s for bench/phases.py's merge against 1 << 18


def cast(array, name: str) -> np.ndarray:
    """`array` in dtype `name`, rounded to nearest even as torch rounds; no copy when it already is."""
    source = to_numpy(array)
    have = _BY_NUMPY.get(source.dtype)
    if have == name:
        return source
    if have is None:  # a dtype we never write (uint32...): numpy's own conversion
        return source.astype(numpy_dtype(name))
    out = np.empty(source.shape, numpy_dtype(name))
    cast_into(out, source)
    return out


def cast_into(dest: np.ndarray, array) -> None:
    """`dest[...] = array`, converted to `dest`'s dtype as `cast` converts, a block of rows at a time
    (the scratch space is a few MB whatever the tensor's size; `dest` may be a strided view)."""
    source = to_numpy(array)
    have, name = _BY_NUMPY.get(source.dtype), _BY_NUMPY.get(dest.dtype)
    if source.shape != dest.shape:
        raise ValueError(f"cannot put a {source.shape} array into a {dest.shape} one")
    if have == name or have is None or name is None:
        np.copyto(dest, source, casting="unsafe")
        return
    if source.ndim == 0:
        source, dest = source.reshape(1), dest.reshape(1)
    rows = max(1, _CAST_BLOCK // max(1, source[:1].size))
    for start in range(0, source.shape[0], rows):
        block = np.ascontiguousarray(source[start:start + rows]).reshape(-1)
        target = dest[start:start + rows]
        if target.flags.c_contiguous:
            _convert(block, have, target.reshape(-1), name)
        else:
            converted = np.empty(block.size, dest.dtype)
            _convert(block, have, converted, name)
            target[...] = converted.reshape(target.shape)


def _convert(block: np.ndarray, have: str, dest: np.ndarray, name: str) -> None:
    """`block` (contiguous, dtype `have`) converted into `dest` (contiguous, dtype `name`)."""
    if have == "bfloat16":
        block = _widen_bfloat16(block)
    if name == "bfloat16":
        # torch's vectorised float32/float64 path writes 0xFFFF for NaN, its float16 path (scalar) 0x7FC0
        nan_bits = 0x7FC0 if have == "float16" else 0xFFFF
        _round_to_bfloat16(block if block.dtype == np.float32 else block.astype(np.float32), dest, nan_bits)
    elif name == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 is Inf, as in torch
            np.copyto(dest, block, casting="unsafe")
        _quiet_nans_to_float16(block, dest)
    else:
        np.copyto(dest, block, casting="unsafe")


def _widen_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> float32 (exact: bfloat16 is float32's upper half)."""
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


def _round_to_bfloat16(values: np.ndarray, dest: np.ndarray, nan_bits: int = 0xFFFF) -> None:
    """float32 -> bfloat16 bits, round to nearest even on the float32 bits (subnormals, Inf and
    overflow to Inf come out right by themselves); every NaN becomes the quiet NaN `nan_bits`."""
    bits = values.view(np.uint32)
    rounded = np.right_shift(bits, 16)
    np.bitwise_and(rounded, 1, out=rounded)
    rounded += 0x7FFF
    rounded += bits  # no overflow: only NaNs lie above -Inf's 0xFF800000
    np.right_shift(rounded, 16, out=dest, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        dest[nan] = nan_bits


def _quiet_nans_to_float16(values: np.ndarray, dest: np.ndarray) -> None:
    """numpy keeps a signalling NaN signalling; torch (like the F16C instruction) sets the quiet bit
    and keeps the sign and the payload's top bits."""
    nan = np.isnan(values)
    if not nan.any():
        return
    if values.dtype != np.float32:
        values = values.astype(np.float32)
    bits = values.view(np.uint32)[nan]
    dest.view(np.uint16)[nan] = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)


def bitwise_equal(a, b) -> bool:
    """Equal shapes, dtypes and bytes (NaN payloads and signed zeros included)."""
    a, b = to_numpy(a), to_numpy(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":  # compare the bits: NaN != NaN as floats
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
        values = cast(flat[start:start + step], "float64")  # exact for every float dtype we write
        counts["nan"] += int(np.count_nonzero(np.isnan(values)))
        counts["+inf"] += int(np.count_nonzero(np.isposinf(values)))
        counts["-inf"] += int(np.count_nonzero(np.isneginf(values)))
    return counts
