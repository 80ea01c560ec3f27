"""Quantizing a weight in row blocks as it is merged, and again when it is proven: one function for both.

Blocks hold whole 128-row bands (fp8's scale blocks; int groups run along rows, so any band works), sized so a
band's float32 copy and its temporaries stay within the worker's budget.

>>> list(aligned_spans(300, 128 * 4 * 3, 128 * 4 * 3 * 128))
[(0, 128), (128, 256), (256, 300)]
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import CheckpointError
from ..numbers.arrays import nonfinite_counts
from ..numbers.nonfinite import add_counts, describe_counts, nonfinite_error
from .kernels import BLOCK, fp8_block_quantize, int_group_quantize
from .schemes import module_of, scheme_of, selected

# Why a weight holding NaN/Inf is never quantized, and what to do instead (`--on-nonfinite warn` plans it unquantized).
QUANTIZED_NONFINITE_FIX = ("a quantized weight cannot hold them (its block or group scale would spread them): pick an "
                           "earlier checkpoint, or pass --on-nonfinite warn to publish such weights unquantized "
                           "(listed in the config's ignore list)")

# float32 copy of the rows and what it becomes (the kernels' own scratch is per sub-band, a few MiB: see
# kernels._SUB_ELEMENTS); kept at 3 copies, which leaves room to spare in the budget
_COPIES = 3
# A band's float32 rows are read, quantized (and, when proven, quantized again, compared and decoded) while they
# are still in the core's cache: bands of ~4 MiB took ~25% less time than budget-sized ones (64 MiB) here.
_CACHED_BAND_BYTES = 4 << 20


def aligned_spans(rows: int, row_bytes: int, budget: int | None):
    """`(start, stop)` bands of whole 128-row blocks within `budget` bytes (at least one block; all rows when
    the budget is 0/None)."""
    step = rows if not budget else max(1, budget // max(1, row_bytes) // BLOCK) * BLOCK
    step = max(step, 1)
    return ((start, min(start + step, rows)) for start in range(0, rows, step))


def parts_of(plan, entry) -> dict:
    """{part: planned tensor} of the quantized weight `entry` belongs to."""
    return {t.part: t for t in plan.in_group(entry.group) if t.source_name == entry.source_name}


def quantize_rows(spec: dict, rows: np.ndarray, scale_dtype: str) -> dict[str, np.ndarray]:
    """{part: array} of float32 `rows` of a weight (whole 128-row blocks, or the tail)."""
    scheme = scheme_of(spec)
    if scheme.kind == "fp8-block":
        codes, scales = fp8_block_quantize(rows)
        return {"weight": codes, "weight_scale_inv": scales}
    packed, scales = int_group_quantize(rows, scheme.bits, scale_dtype)
    return {"weight_packed": packed, "weight_scale": scales}


def source_bands(source, name: str, budget: int | None):
    """`(start, float32 rows)` of source tensor `name` in aligned bands (one read when the source cannot stream)."""
    info = source.tensors()[name]
    rows, cols = info.shape
    spans = list(aligned_spans(rows, cols * 4 * _COPIES, min(budget or sys.maxsize, _CACHED_BAND_BYTES * _COPIES)))
    whole = None if source.streams(name) and len(spans) > 1 else source.read(name, "float32")
    for low, high in spans:
        yield low, (whole[low:high] if whole is not None else source.read_rows(name, low, high, "float32"))


def nonfinite_weights(source, spec: dict, budget: int | None) -> dict[str, dict[str, int]]:
    """{module: NaN/Inf counts} of the 2-D weights `spec` selects that hold any, read as quantizing reads them (float32
    bands). The merge that publishes such values (`--on-nonfinite warn`) plans these weights unquantized, so it must
    know them before any header is fixed: one read of the selected weights, paid only with warn."""
    found = {}
    for name, info in source.tensors().items():
        if len(info.shape) != 2 or not selected(name, info.shape, spec):
            continue  # other shapes are refused when the plan is made (`schemes.check_shape`)
        counts = None
        for _, rows in source_bands(source, name, budget):
            counts = add_counts(counts, nonfinite_counts(rows))
        if counts:
            found[module_of(name)] = counts
    return found


def quantized_blocks(source, plan, entry, budget: int | None, on_nonfinite: str):
    """`(planned part, first row, block)` for every part of the quantized weight whose primary part is `entry`
    (nothing for its other parts: they come with the primary).

    A weight planned quantized never publishes NaN/Inf: rows holding any are refused whatever `on_nonfinite` says
    (with warn, the plan already keeps such weights unquantized, so finding one here means the checkpoint changed
    since), and so is a scale the scale dtype cannot hold (fp16 scales of values above ~4.9e5)."""

    spec = plan.quantization
    if entry.part != scheme_of(spec).primary:
        return
    parts = parts_of(plan, entry)
    scale_dtype = parts.get("weight_scale", entry).dtype
    if "weight_shape" in parts:
        yield parts["weight_shape"], 0, np.array(source.tensors()[entry.source_name].shape, np.int64)
    for low, rows in source_bands(source, entry.source_name, budget):
        counts = nonfinite_counts(rows)
        if counts:
            fix = QUANTIZED_NONFINITE_FIX if on_nonfinite == "fail" else \
                "it held none when the merge was planned, so the checkpoint changed during the merge: merge again"
            raise nonfinite_error({entry.source_name: counts}, source.location, fix)
        for part, block in quantize_rows(spec, np.ascontiguousarray(rows, np.float32), scale_dtype).items():
            if part != scheme_of(spec).primary and nonfinite_counts(block):
                raise CheckpointError(
                    f"{entry.source_name} in {source.location}: its {part} overflow {scale_dtype} "
                    f"({describe_counts(nonfinite_counts(block))}): merge with --dtype bf16, or keep it unquantized "
                    f"with --quantize-ignore '{module_of(entry.source_name)}'")
            yield parts[part], low // BLOCK if part == "weight_scale_inv" else low, block
