"""`arrays.cast` rounds to bfloat16 and float16 in plain numpy: bit for bit what torch's `.to()` gives.

Expected bits come from torch itself on the same inputs; the edge values are built from their bit
patterns so each case is exactly the one named.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mergecore.numbers.arrays import cast, cast_into, dtype_of, to_numpy, to_torch


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


EDGES = {
    "zeros": f32(0x0000_0000, 0x8000_0000),
    "tie to even, down": f32(0x3F80_8000),               # 1 + 2^-8: halfway, even neighbour below
    "tie to even, up": f32(0x3F81_8000),                 # halfway, even neighbour above
    "just above / below a tie": f32(0x3F80_8001, 0x3F80_7FFF, 0xBF80_8001, 0xBF80_7FFF),
    "carry into the exponent": f32(0x3FFF_8000, 0x3FFF_FFFF),
    "subnormals": f32(0x0000_0001, 0x0000_8000, 0x0000_8001, 0x0001_8000, 0x007F_FFFF, 0x8000_0001, 0x807F_8000),
    "smallest normal": f32(0x0080_0000, 0x0080_7FFF, 0x0080_8000),
    "infinities": f32(0x7F80_0000, 0xFF80_0000),
    "max finite": f32(0x7F7F_0000, 0xFF7F_0000),
    "rounds to infinity": f32(0x7F7F_8000, 0x7F7F_FFFF, 0xFF7F_8000, 0xFF7F_FFFF),
    "just under infinity": f32(0x7F7F_7FFF, 0xFF7F_7FFF),
    "NaNs (quiet, signalling, negative, payloads)": f32(0x7FC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7FFF_FFFF,
                                                        0xFFFF_FFFF, 0x7FBF_FFFF, 0x7F80_8000),
}


def torch_bits(values: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy(values.copy()).to(dtype).view(torch.int16).numpy().view(np.uint16)


def our_bits(values: np.ndarray, name: str) -> np.ndarray:
    return cast(values, name).view(np.uint16)


@pytest.mark.parametrize("case", list(EDGES))
@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_edge_values_round_as_torch_does(case, name, dtype):
    values = EDGES[case]
    assert np.array_equal(our_bits(values, name), torch_bits(values, dtype)), [hex(b) for b in values.view(np.uint32)]


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_every_kind_of_float32_rounds_as_torch_does(name, dtype):
    """Random bit patterns (every exponent, NaNs included) and values near fp16's range, across block edges."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 700_003, dtype=np.uint64).astype(np.uint32)
    near_half = (rng.standard_normal(300_001) * 30000).astype(np.float32)
    for values in (bits.view(np.float32), near_half, near_half.reshape(-1, 1)[::3]):
        assert np.array_equal(our_bits(values, name), torch_bits(np.ascontiguousarray(values), dtype))


def test_other_conversions_match_torch():
    """bfloat16 -> float32/float16/float64 and float64/float16 -> bfloat16, as torch converts."""
    rng = np.random.default_rng(1)
    source = torch.from_numpy(rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32))
    bf16 = source.to(torch.bfloat16)
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("float64", torch.float64)):
        ours, theirs = cast(to_numpy(bf16), name), bf16.to(dtype).numpy()
        assert ours.dtype == theirs.dtype
        assert np.array_equal(ours, theirs, equal_nan=True)
        assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    for wide in (source.to(torch.float64), source.to(torch.float16)):
        assert np.array_equal(our_bits(wide.numpy(), "bfloat16"),
                              wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_bfloat16_arrays_are_their_bits_and_round_trip_through_torch():
    tensor = torch.tensor([[1.5, -2.0], [float("inf"), 3.0e38]], dtype=torch.bfloat16)
    bits = to_numpy(tensor)
    assert bits.dtype == np.uint16 and dtype_of(bits) == "bfloat16"
    assert torch.equal(to_torch(bits), tensor)
    into = np.zeros((2, 4), np.uint16)
    cast_into(into[:, ::2], tensor.float().numpy())  # a strided destination
    assert np.array_equal(into[:, ::2], bits) and not into[:, 1::2].any()


def test_merge_path_imports_neither_ml_dtypes_nor_torch():
    code = ("import sys, mergecore, mergecore.formats.fsdp, mergecore.engine.merge, mergecore.proofs.verify; "
            "print(sorted(m for m in ('ml_dtypes', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
