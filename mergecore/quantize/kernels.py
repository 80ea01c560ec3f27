"""The arithmetic of each scheme on numpy row blocks (no torch, no compressed-tensors: the merge path stays light).

fp8-block: per 128x128 block, scale = amax / 448 (float32), values = e4m3fn(x / scale), rounded to nearest even;
the stored `weight_scale_inv` is that scale (a loader multiplies). int (w8a16, w4a16): per row and 128 columns,
scale = amax / ((2^bits - 1) / 2) rounded to the scale dtype, q = clamp(round(x / scale), -2^(bits-1), 2^(bits-1)-1)
with the stored scale, packed as compressed-tensors' pack-quantized does (q + 2^(bits-1), little-endian in int32).

Speed: a band is worked through in sub-bands of about `_SUB_ELEMENTS` values (whole 128-row blocks for fp8), each
pass in place on scratch arrays allocated once per band, so a pass's arrays stay in the core's cache and no pass
pays for fresh pages. fp8 rounds in the float adder (`_fp8_codes_into`). A sub-band holding NaN/Inf (or, for fp8,
a block so small that its scale is subnormal) takes the plain arithmetic (`_fp8_codes_reference`, the int
reference), which gives the same bytes for every finite value: tests compare both with torch and compressed-tensors.
(A merge never hands them NaN/Inf: `stream.quantized_blocks` refuses such rows first, since no scale carries them.)

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
_MIN_NORMAL_EXPONENT = 121   # float32 exponent field of 2^-6, e4m3's smallest normal
# Values per sub-band: its float32 scratch arrays (1 MiB each) stay in a core's 2-4 MiB cache between passes.
_SUB_ELEMENTS = 1 << 18
# fp8's fast path needs x / scale < 464 (the midpoint of 448 and 480): true when scale = amax / 448 is a normal
# float32, i.e. amax >= 448 * 2^-126; any smaller (nonzero) amax takes the reference path.
_FP8_SMALLEST_FAST_AMAX = 2.0 ** -100


def _sub_rows(rows: int, cols: int, multiple: int) -> int:
    """Rows per sub-band: about `_SUB_ELEMENTS` values, a multiple of `multiple` rows (at least one)."""
    return min(rows, max(multiple, _SUB_ELEMENTS // max(1, cols) // multiple * multiple))


def _scratch(elements: int, *dtypes) -> list[np.ndarray]:
    return [np.empty(elements, dtype) for dtype in dtypes]


def _rows_of(flat: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The first `rows` x `cols` values of a flat scratch array, as a 2-D view."""
    return flat[:rows * cols].reshape(rows, cols)


def _largest(values: np.ndarray, axis=None):
    """`np.fmax.reduce(values, axis)` (NaN left out, 0 when empty) of float32 values >= 0 or NaN, through their
    bits: unsigned integers order such floats as the floats do and reduce ~3x faster; every NaN's bits lie above
    +Inf's (0x7F800000), so a result above that means a NaN was there, and then fmax decides.

    >>> _largest(np.array([[0.5, 2.0], [np.inf, 1.0]], np.float32), axis=1).tolist()
    [2.0, inf]
    >>> float(_largest(np.array([np.nan, 3.0], np.float32)))
    3.0
    """
    top = values.view(np.uint32).max(axis=axis, initial=0)
    if np.any(top > 0x7F800000):
        return np.fmax.reduce(values, axis=axis, initial=0.0)
    return np.asarray(top).view(np.float32)


def fp8_codes(values: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bits (uint8), round to nearest even, as torch's `.to(torch.float8_e4m3fn)` for
    |x| <= 448 (callers clamp); NaN -> 0x7F. Finite values below 464 take the fast `_fp8_codes_into`, anything
    else `_fp8_codes_reference`."""
    values = np.ascontiguousarray(values, np.float32)
    magnitude = np.abs(values).reshape(-1)
    if not float(magnitude.max(initial=0.0)) < 464.0:  # NaN compares False too
        return _fp8_codes_reference(values)
    codes = np.empty(values.shape, np.uint8)
    sign_and_magic, exponent = _scratch(values.size, np.uint32, np.uint32)
    _fp8_codes_into(magnitude, values.reshape(-1).view(np.uint32), sign_and_magic, exponent, codes.reshape(-1))
    return codes


def _fp8_codes_into(magnitude, signed_bits, magic, exponent, codes) -> None:
    """e4m3fn codes of finite x, |x| < 464, into `codes`, rounded by the float adder: nine in-place passes.

    Flat arrays: `magnitude` float32 |x| (destroyed), `signed_bits` x's uint32 bits (read for the sign), `magic`
    and `exponent` uint32 scratch, `codes` uint8. Adding M = 2^(e+20) to |x| (e: |x|'s exponent, at least -6,
    where e4m3's subnormals begin) rounds |x| to nearest even at M's last bit, 2^(e-3): e4m3's step at that
    exponent; the sum's low mantissa bits then count the steps. M also carries in its low mantissa bits 8*(e+6)
    (the code of 2^e, less the 8 steps of [2^e, 2^(e+1)) counted by the sum) and 128 for a negative x (the code's
    sign bit). Both are even, so the tie still goes to the even code, and the sum's low byte is the code.

    >>> x = np.array([448.0, -1.0, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, -0.0, 460.0], np.float32)
    >>> codes, (magic, exponent) = np.empty(8, np.uint8), _scratch(8, np.uint32, np.uint32)
    >>> _fp8_codes_into(np.abs(x), x.view(np.uint32), magic, exponent, codes)
    >>> [hex(c) for c in codes]
    ['0x7e', '0xb8', '0x0', '0x2', '0x38', '0x3a', '0x80', '0x7e']
    """
    sum_bits = magnitude.view(np.uint32)
    np.right_shift(signed_bits, np.uint32(24), out=magic)
    np.bitwise_and(magic, np.uint32(0x80), out=magic)                        # 128 for a negative x
    np.right_shift(sum_bits, np.uint32(23), out=exponent)                    # e + 127
    np.clip(exponent, np.uint32(_MIN_NORMAL_EXPONENT), np.uint32(255), out=exponent)  # ~3x np.maximum's speed
    np.multiply(exponent, np.uint32((1 << 23) + 8), out=exponent)            # 2^e's bits + 8 * (e + 127)
    magic += exponent
    magic += np.uint32((20 << 23) - 8 * _MIN_NORMAL_EXPONENT)                # 2^e -> 2^(e+20); 8*(e+127) -> 8*(e+6)
    magnitude += magic.view(np.float32)
    np.copyto(codes, sum_bits, casting="unsafe")                              # the low byte


def _fp8_codes_reference(values: np.ndarray) -> np.ndarray:
    """`fp8_codes` by plain integer arithmetic on the float32 bits (any input; NaN -> 0x7F): the path for NaN/Inf."""
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


def _fp8_values_into(codes, out) -> None:
    """`fp8_values` of flat uint8 `codes` into float32 `out` by bit arithmetic: the code as a signed byte, times
    2^20 and masked, puts its sign at float32's bit 31 and its 7 magnitude bits at bit 20, which make its value
    times 2^-120 (e4m3's subnormals land on float32's). NaN codes (0x7F, 0xFF) go through the table.

    >>> out = np.empty(256, np.float32)
    >>> _fp8_values_into(np.arange(256, dtype=np.uint8), out)
    >>> np.array_equal(out, fp8_values(np.arange(256)), equal_nan=True)
    True
    """
    bits = out.view(np.int32)
    np.copyto(bits, codes.view(np.int8))                  # code - 256 * sign
    np.left_shift(bits, np.int32(20), out=bits)           # a negative code borrows into bits 27..31
    np.bitwise_and(bits, np.int32(-0x78100000), out=bits)  # keep bit 31 and bits 20..26 (0x87F00000)
    if int(bits.max(initial=0)) == 0x7F << 20 or int(bits.view(np.uint32).max(initial=0)) == 0x87F00000:
        np.take(_FP8_TABLE, codes, out=out)  # the largest magnitude is 0x7F: a NaN code, positive or negative
        return
    out *= np.float32(2.0 ** 120)


def _block_amax(magnitude: np.ndarray) -> np.ndarray:
    """Largest |x| of each 128x128 block of `magnitude` [r, c] (rows first: contiguous, vectorised passes)."""
    r, c = magnitude.shape
    bits = magnitude.view(np.uint32)  # |x| >= 0 (or NaN, above +Inf): ordered as integers, reduced faster
    top = bits.reshape(r // BLOCK, BLOCK, c).max(axis=1).reshape(r // BLOCK, c // BLOCK, BLOCK).max(axis=2)
    return top.view(np.float32)


def _fp8_scales(amax: np.ndarray) -> np.ndarray:
    return np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)


def _fp8_fast(amax: np.ndarray) -> bool:
    """Whether every block's values divided by its scale are finite and below 464 (see `_FP8_SMALLEST_FAST_AMAX`)."""
    return bool(np.isfinite(amax).all()) and not bool(((amax > 0) & (amax < _FP8_SMALLEST_FAST_AMAX)).any())


def _per_block(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values` [r, c] as 128x128 blocks, and `scales` shaped to broadcast over them."""
    r, c = values.shape
    return values.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK), scales[:, None, :, None]


def fp8_block_quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows (whole 128x128 blocks: `schemes.check_shape` refuses other shapes) -> (e4m3fn bits, float32
    scales [rows/128, cols/128]). An all-zero block gets scale 1 (its values are 0 whatever the scale)."""
    rows = np.ascontiguousarray(rows, np.float32)
    r, c = rows.shape
    codes, scales = np.empty((r, c), np.uint8), np.empty((r // BLOCK, c // BLOCK), np.float32)
    step = _sub_rows(r, c, BLOCK)
    magnitude, magic, exponent = _scratch(min(r, step) * c, np.float32, np.uint32, np.uint32)
    for low in range(0, r, step):
        part = rows[low:low + step]
        k = part.shape[0]
        span = slice(low // BLOCK, (low + k) // BLOCK)
        scaled = np.abs(part, out=_rows_of(magnitude, k, c))
        amax = _block_amax(scaled)
        scales[span] = _fp8_scales(amax)
        if not _fp8_fast(amax):
            codes[low:low + k] = _fp8_block_reference(part, scales[span])
            continue
        np.divide(*_per_block(scaled, scales[span]), out=_per_block(scaled, scales[span])[0])  # |x / scale|
        _fp8_codes_into(scaled.reshape(-1), part.reshape(-1).view(np.uint32), magic[:k * c], exponent[:k * c],
                        codes[low:low + k].reshape(-1))
    return codes, scales


def _fp8_block_reference(part: np.ndarray, scales: np.ndarray) -> np.ndarray:
    blocks, per_block = _per_block(part, scales)
    scaled = blocks / per_block
    np.clip(scaled, -FP8_MAX, FP8_MAX, out=scaled)
    return _fp8_codes_reference(scaled.reshape(part.shape))


def fp8_block_errors(rows: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[float, float]:
    """(largest |decoded - x|, largest |decoded - x| / bound) over float32 `rows` and their e4m3fn `codes` and
    block `scales`; NaN left out (an Inf in the checkpoint makes the largest error Inf). The bound: half a step
    of e4m3 (3 mantissa bits: 2^-4 of |x|), or of its subnormals (2^-10 of the scale), plus float32 rounding of
    x / scale. Decodes the codes by bit arithmetic (`_fp8_values_into`), independent of the rounding's.

    >>> rows = np.full((128, 128), 0.3, np.float32)
    >>> codes, scales = fp8_block_quantize(rows)
    >>> fp8_block_errors(rows, codes, scales)
    (0.0, 0.0)
    """
    rows = np.ascontiguousarray(rows, np.float32)
    r, c = rows.shape
    step = _sub_rows(r, c, BLOCK)
    decoded, bound = _scratch(min(r, step) * c, np.float32, np.float32)
    worst = ratio = 0.0
    for low in range(0, r, step):
        part = rows[low:low + step]
        k = part.shape[0]
        per_block = scales[low // BLOCK:(low + k) // BLOCK]
        error = _rows_of(decoded, k, c)
        _fp8_values_into(codes[low:low + k].reshape(-1), error.reshape(-1))
        blocks, scale = _per_block(error, per_block)
        blocks *= scale
        error -= part
        np.abs(error, out=error)
        allowed = np.abs(part, out=_rows_of(bound, k, c))
        allowed *= np.float32(2.0 ** -4 + 2.0 ** -20)
        blocks, _ = _per_block(allowed, per_block)
        blocks += (per_block * np.float32(2.0 ** -10))[:, None, :, None]
        worst = max(worst, float(_largest(error)))
        share = np.divide(error, allowed, out=allowed)  # NaN where the checkpoint holds NaN/Inf: left out
        ratio = max(ratio, float(_largest(share)))
    return worst, ratio


def int_range(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def int_group_quantize(rows: np.ndarray, bits: int, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [r, c] (c a multiple of 128) -> (packed int32 [r, c * bits / 32], scales [r, c / 128] in
    `scale_dtype`'s storage). Zero groups get the scale dtype's epsilon, as compressed-tensors does.

    >>> packed, scales = int_group_quantize(np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256), 4, "float32")
    >>> unpack_int32(packed, 4)[0, [0, 1, 127, 128, 255]].tolist(), scales.tolist()
    ([-7, -7, 0, 0, 7], [[0.13333334028720856, 0.13333334028720856]])
    """
    rows = np.ascontiguousarray(rows, np.float32)
    r, c = rows.shape
    packed = np.empty((r, c * bits // 8), np.uint8)
    stored = []
    step = _sub_rows(r, c, 1)
    scaled, unsigned = _scratch(min(r, step) * c, np.float32, np.uint8)
    pairs = np.empty(min(r, step) * c // 2, np.uint16)
    for low in range(0, r, step):
        part = rows[low:low + step]
        k = part.shape[0]
        magnitude = np.abs(part, out=_rows_of(scaled, k, c))
        amax = _group_amax(magnitude)
        scale, used = _int_scales(amax, bits, scale_dtype)
        stored.append(scale)
        if not np.isfinite(amax).all():  # NaN/Inf: the reference arithmetic (its NaN -> int conversion kept)
            packed[low:low + k] = pack_int32(_int_codes_reference(part, used, bits), bits).view(np.uint8)
            continue
        _int_codes_into(part, used, bits, magnitude, _rows_of(unsigned, k, c), _rows_of(pairs, k, c // 2),
                        packed[low:low + k])
    return np.ascontiguousarray(packed).view("<i4"), np.concatenate(stored)


def _group_amax(magnitude: np.ndarray) -> np.ndarray:
    """Largest |x| of each row's 128-column groups of `magnitude` [k, c] (through the bits, as `_block_amax`)."""
    k, c = magnitude.shape
    return magnitude.view(np.uint32).reshape(k, c // GROUP, GROUP).max(axis=2).view(np.float32)


def _int_scales(amax: np.ndarray, bits: int, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the stored scales in `scale_dtype`'s storage, the same as float32 for dividing)."""
    low, high = int_range(bits)
    stored = cast(amax / np.float32((high - low) / 2), scale_dtype)
    used = cast(stored, "float32")
    used = np.where(used == 0, np.float32(_EPS[scale_dtype]), used)
    return cast(used, scale_dtype), used


def _int_codes_into(part, used, bits: int, scaled, unsigned, pairs_scratch, packed) -> None:
    """Finite `part` [k, c] quantized with float32 group scales `used` and packed into uint8 `packed`, in place on
    float32 `scaled`, uint8 `unsigned` [k, c] and uint16 `pairs_scratch` [k, c / 2]: clamping before rounding
    gives what rounding then clamping does (the ends are integers), and the offset 2^(bits-1) is added in float32,
    exactly."""
    k, c = part.shape
    low, high = int_range(bits)
    np.divide(part.reshape(k, c // GROUP, GROUP), used[:, :, None], out=scaled.reshape(k, c // GROUP, GROUP))
    np.clip(scaled, low, high, out=scaled)
    np.rint(scaled, out=scaled)
    scaled += np.float32(-low)
    if bits == 8:
        np.copyto(packed, scaled, casting="unsafe")
        return
    np.copyto(unsigned, scaled, casting="unsafe")
    # two 4-bit values per byte, the first low: as (little-endian) uint16 pairs `first | second << 8`,
    # `pair | pair >> 4` holds `first | second << 4` in its low byte (contiguous passes: ~5x the speed of
    # numpy's stride-2 byte loops)
    pairs = unsigned.view(np.uint16)
    shifted = np.right_shift(pairs, np.uint16(4), out=pairs_scratch)
    np.bitwise_or(shifted, pairs, out=shifted)
    np.copyto(packed, shifted, casting="unsafe")


def _int_codes_reference(part: np.ndarray, used: np.ndarray, bits: int) -> np.ndarray:
    low, high = int_range(bits)
    k, c = part.shape
    scaled = part.reshape(k, c // GROUP, GROUP) / used[:, :, None]
    np.rint(scaled, out=scaled)
    np.clip(scaled, low, high, out=scaled)
    return scaled.astype(np.int8).reshape(k, c)


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


def int_group_errors(rows: np.ndarray, packed: np.ndarray, scales: np.ndarray, bits: int) -> tuple[float, float]:
    """(largest |decoded - x|, largest group error / bound) of float32 `rows` and their packed codes and group
    scales (stored dtype); NaN left out, as in `fp8_block_errors`. The bound, per group: half a step of the
    stored scale, plus what the scale's own rounding (at most 2^-8 relative, bf16) can push past the clamp at the
    range's ends, plus float32 rounding of the group's largest x.

    >>> rows = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
    >>> worst, ratio = int_group_errors(rows, *int_group_quantize(rows, 4, "bfloat16"), 4)
    >>> round(worst, 4), ratio < 1
    (0.0667, True)
    """
    rows = np.ascontiguousarray(rows, np.float32)
    r, c = rows.shape
    raw = np.ascontiguousarray(packed).view(np.uint8)
    scale = cast(scales, "float32")
    step = _sub_rows(r, c, 1)
    decoded, magnitude = _scratch(min(r, step) * c, np.float32, np.float32)
    pairs, spread = _scratch(min(r, step) * c // 2, np.uint16, np.uint16) if bits == 4 else (None, None)
    worst = ratio = 0.0
    for low in range(0, r, step):
        part = rows[low:low + step]
        k = part.shape[0]
        error = _rows_of(decoded, k, c)
        if bits == 8:
            np.copyto(error, raw[low:low + k])
        else:
            # byte `first | second << 4` -> uint16 `first | second << 8`, i.e. the two values as bytes, in order
            byte, both = _rows_of(pairs, k, c // 2), _rows_of(spread, k, c // 2)
            np.copyto(byte, raw[low:low + k])
            np.left_shift(byte, np.uint16(4), out=both)
            np.bitwise_or(both, byte, out=both)
            np.bitwise_and(both, np.uint16(0x0F0F), out=both)
            np.copyto(error, both.view(np.uint8))
        error -= np.float32(1 << (bits - 1))
        groups = error.reshape(k, c // GROUP, GROUP)
        groups *= scale[low:low + k, :, None]
        error -= part
        np.abs(error, out=error)
        # the bound is one number per group: compare the group's largest error with it
        group_error = _largest(groups, axis=2)
        amax = _group_amax(np.abs(part, out=_rows_of(magnitude, k, c)))
        bound = scale[low:low + k] * np.float32(0.5 + (1 << bits) * 2.0 ** -9) + amax * np.float32(2.0 ** -20)
        worst = max(worst, float(_largest(group_error)))
        share = np.divide(group_error, bound, out=bound)  # NaN where the checkpoint holds NaN/Inf: left out
        ratio = max(ratio, float(_largest(share)))
    return worst, ratio
