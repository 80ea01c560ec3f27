"""The arithmetic of each scheme on numpy row blocks (no torch, no compressed-tensors: the merge path stays light).

fp8-block: per 128x128 block, scale = amax / 448 (float32), values = e4m3fn(x / scale), rounded to nearest even;
the stored `weight_scale_inv` is that scale (a loader multiplies). int (w8a16, w4a16): per row and 128 columns,
scale = amax / ((2^bits - 1) / 2) rounded to the scale dtype, q = clamp(round(x / scale), -2^(bits-1), 2^(bits-1)-1)
with the stored scale, packed as compressed-tensors' pack-quantized does (q + 2^(bits-1), little-endian in int32).

>>> codes = fp8_codes(np.array([448.0, 1.0, -0.0, 2.0 ** -9, 3.0 * 2.0 ** -10], np.float32))
>>> [hex(c) for c in codes], fp8_values(codes).tolist()
(['0x7e', '0x38', '0x80', '0x1', '0x2'], [448.0, 1.0, -0.0, 0.001953125, 0.00390625])
"""

from __future__ import annotations

import numpy as np

from ..numbers.arrays import cast

BLOCK = 128            # fp8 block edge (rows and columns)
GROUP = 128            # int group size (columns)
FP8_MAX = 448.0
_FP8_MIN_NORMAL = 2.0 ** -6


def fp8_codes(values: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bits (uint8), round to nearest even, as torch's `.to(torch.float8_e4m3fn)` for
    |x| <= 448 (callers clamp); NaN -> 0x7F. In place on uint32 scratch: a few passes over the block."""
    values = np.ascontiguousarray(values, np.float32)
    magnitude = np.abs(values)
    bits = magnitude.view(np.uint32)
    # normals: keep 3 of float32's 23 mantissa bits, rounding to even; rebias the exponent from 127 to 7
    rounded = bits >> np.uint32(20)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFFF)
    rounded += bits
    rounded >>= np.uint32(20)
    rounded -= np.uint32((127 - 7) << 3)  # wraps for subnormals: replaced below
    codes = rounded.astype(np.uint8)
    # subnormals (and the carry into the smallest normal): multiples of 2^-9, rint rounds half to even
    small = magnitude < _FP8_MIN_NORMAL
    if small.any():
        codes[small] = np.rint(magnitude[small] * np.float32(512.0)).astype(np.uint8)
    codes |= (values.view(np.uint32) >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    nan = np.isnan(magnitude)
    if nan.any():
        codes[nan] = 0x7F
    return codes


def _fp8_table() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    table = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    table[[0x7F, 0xFF]] = np.nan
    return table


_FP8_TABLE = _fp8_table()


def fp8_values(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits -> float32 (exact)."""
    return _FP8_TABLE[np.asarray(codes, np.uint8)]


def fp8_block_quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows (whole 128x128 blocks: `schemes.check_shape` refuses other shapes) -> (e4m3fn bits, float32
    scales [rows/128, cols/128]). An all-zero block gets scale 1 (its values are 0 whatever the scale)."""
    r, c = rows.shape
    blocks = rows.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)  # a view: the scales broadcast, never expanded
    amax = np.maximum(blocks.max(axis=(1, 3)), -blocks.min(axis=(1, 3)))
    scales = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    scaled = blocks / scales[:, None, :, None]
    np.clip(scaled, -FP8_MAX, FP8_MAX, out=scaled)
    return fp8_codes(scaled.reshape(r, c)), scales


def _per_block(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values` [r, c] as 128x128 blocks, and `scales` shaped to broadcast over them."""
    r, c = values.shape
    return values.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK), scales[:, None, :, None]


def fp8_block_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    blocks, per_block = _per_block(fp8_values(codes), scales)
    return (blocks * per_block).reshape(codes.shape)


def fp8_block_bound(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """How far a dequantized value may lie from its source: half a step of e4m3 (3 mantissa bits: 2^-4 of |x|),
    or of its subnormals (2^-10 of the scale), plus float32 rounding of x / scale."""
    blocks, per_block = _per_block(np.abs(rows), scales)
    return (blocks * np.float32(2.0 ** -4 + 2.0 ** -20) + per_block * np.float32(2.0 ** -10)).reshape(rows.shape)


def int_range(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def int_group_quantize(rows: np.ndarray, bits: int, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [r, c] (c a multiple of 128) -> (packed int32 [r, c * bits / 32], scales [r, c / 128] in
    `scale_dtype`'s storage). Zero groups get the scale dtype's epsilon, as compressed-tensors does."""
    low, high = int_range(bits)
    r, c = rows.shape
    groups = rows.reshape(r, c // GROUP, GROUP)
    amax = np.maximum(groups.max(axis=2), -groups.min(axis=2))
    scale = amax / np.float32((high - low) / 2)
    stored = cast(scale, scale_dtype)
    used = cast(stored, "float32")
    used = np.where(used == 0, np.float32(_EPS[scale_dtype]), used)
    stored = cast(used, scale_dtype)
    scaled = groups / used[:, :, None]
    np.rint(scaled, out=scaled)
    np.clip(scaled, low, high, out=scaled)
    q = scaled.astype(np.int8).reshape(r, c)
    return pack_int32(q, bits), stored


_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": float(np.finfo(np.float32).eps)}


def pack_int32(q: np.ndarray, bits: int) -> np.ndarray:
    """int8 values in [-2^(bits-1), 2^(bits-1)) -> int32 words, 32 / bits values each, first value in the lowest
    bits (pack-quantized: values offset by 2^(bits-1))."""
    unsigned = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 8:
        packed = unsigned
    elif bits == 4:
        packed = unsigned[:, 0::2] | (unsigned[:, 1::2] << np.uint8(4))
    else:
        raise ValueError(f"{bits}-bit packing is not supported")
    return np.ascontiguousarray(packed).view("<i4")


def unpack_int32(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `pack_int32`."""
    raw = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 4:
        raw = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return (raw.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def int_group_dequantize(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    q = unpack_int32(packed, bits).astype(np.float32)
    r, c = q.shape
    return (q.reshape(r, c // GROUP, GROUP) * cast(scales, "float32")[:, :, None]).reshape(r, c)


def int_group_bound(rows: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Per group [r, c/128]: half a step of the stored scale, plus what the scale's own rounding (at most 2^-8
    relative, bf16) can push past the clamp at the range's ends, plus float32 rounding of the group's largest x."""
    r, c = rows.shape
    groups = rows.reshape(r, c // GROUP, GROUP)
    amax = np.maximum(groups.max(axis=2), -groups.min(axis=2))
    return cast(scales, "float32") * np.float32(0.5 + (1 << bits) * 2.0 ** -9) + amax * np.float32(2.0 ** -20)
