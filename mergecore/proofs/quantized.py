"""Proof of a quantized folder: every output block is exactly the quantization of the checkpoint's rows (quantized
again from the rank files), its decoded value lies within the scheme's bound of them, and every unquantized tensor
passes the plain round trip.

>>> with HfWeights("out/model") as weights:  # doctest: +SKIP
...     quantized_round_trip(source, weights.get, prepared.plan, "out/model")["max_error_vs_bound"]
0.98
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import VerificationError
from ..numbers.arrays import bitwise_equal, nonfinite_counts
from ..numbers.budget import chunk_bytes
from ..numbers.nonfinite import describe_counts
from ..quantize.kernels import BLOCK, fp8_block_errors, int_group_errors
from ..quantize.schemes import scheme_of
from ..quantize.stream import quantize_rows, source_bands
from ..storage import Location

# `changed(path, why)`: the error for a published file that is no longer what the merge wrote (`verify.file_changed`)
Changed = Callable[[object, str], VerificationError]


def quantized_round_trip(source, get, plan, folder, workers: int = 2, held: set[str] | None = None,
                         changed: Changed | None = None) -> dict:
    """Every quantized weight of `plan` (or those whose parts are among the output names `held`: one weight file's)
    proven against the checkpoint (`check_quantized`), each output tensor read with `get(name)`; returns the scheme
    and the measured errors for the round-trip record. `folder`: the model's folder or URL (errors name the file in
    it). `changed`: given when a published model is verified (its merge proved it before publishing): a part that
    is not the quantization of the checkpoint is then that error, not a wrong merge."""
    parts: dict[str, dict] = {}
    for t in plan.tensors:
        if t.part and (held is None or t.name in held):
            parts.setdefault(t.source_name, {})[t.part] = t
    with ThreadPoolExecutor(max(1, workers)) as pool:
        errors = list(pool.map(lambda name: check_quantized(source, get, plan.quantization, name, parts[name], folder,
                                                            changed), sorted(parts)))
    return {"scheme": plan.quantization["scheme"], "quantized": len(parts),
            "max_abs_error": max((e for e, _ in errors), default=0.0),
            "max_error_vs_bound": round(max((r for _, r in errors), default=0.0), 4)}


def check_quantized(source, get, spec: dict, name: str, parts: dict, folder, changed: Changed | None = None
                    ) -> tuple[float, float]:
    """(max |decoded - source|, max error / bound) of one weight, after proving its parts bit for bit. The checkpoint's
    rows must be finite (a merge never quantizes NaN/Inf: `quantize.stream.quantized_blocks`)."""
    scheme = scheme_of(spec)
    scale_dtype = parts["weight_scale"].dtype if "weight_scale" in parts else "float32"
    outputs = {part: get(t.name) for part, t in parts.items()}

    def differs(part: str, what: str) -> VerificationError:
        path = _file_in(folder, parts[part].file)
        why = f"{name}'s {what} is not the quantization of the checkpoint's values"
        return changed(path, why) if changed else VerificationError(
            f"{path}: {why}; the merge is wrong: do not publish it (please report this)")

    if "weight_shape" in outputs and list(outputs["weight_shape"]) != list(source.tensors()[name].shape):
        raise differs("weight_shape", "weight_shape")
    worst, ratio = 0.0, 0.0
    for low, rows in source_bands(source, name, chunk_bytes()):
        rows = np.ascontiguousarray(rows, np.float32)
        counts = nonfinite_counts(rows)
        if counts:  # the merge refused these, or kept the weight unquantized: the checkpoint is not the one merged
            raise VerificationError(f"{source.location}: {name} holds {describe_counts(counts)} but was published "
                                    f"quantized in {folder}; the checkpoint changed after the merge (or is another "
                                    "one): pass the checkpoint it was merged from, or merge again")
        high = low + rows.shape[0]
        mine = {}
        for part, block in quantize_rows(spec, rows, scale_dtype).items():
            span = slice(low // BLOCK, -(-high // BLOCK)) if part == "weight_scale_inv" else slice(low, high)
            mine[part] = outputs[part][span]
            if not bitwise_equal(mine[part], block):
                raise differs(part, f"{part} rows {span.start}..{span.stop}")
        # the bound check decodes the parts just proven equal to the written ones (no second read of the file)
        if scheme.kind == "fp8-block":
            band_worst, band_ratio = fp8_block_errors(rows, mine["weight"], mine["weight_scale_inv"])
        else:
            band_worst, band_ratio = int_group_errors(rows, mine["weight_packed"], mine["weight_scale"], scheme.bits)
        if band_ratio > 1.0:  # bit for bit our own quantization, yet beyond the bound: the kernels are wrong
            raise VerificationError(f"{folder}: {name} decodes beyond the {scheme.name} bound of the checkpoint "
                                    f"({band_ratio:.3g} times the bound); do not publish it (please report this)")
        worst = max(worst, band_worst)
        ratio = max(ratio, band_ratio)
    return worst, ratio


def _file_in(folder, file: str):
    """Output file `file` of the model at `folder` (a local folder or a `storage.Location`), for error messages."""
    return folder.join(file) if isinstance(folder, Location) else Path(folder) / file


def quantized_errors(plan, receipts: list[dict]) -> dict:
    """The round-trip record's quantized part (as a local folder's: scheme, weights, largest errors) from the
    receipts of the files that hold them; {} for a plain merge."""
    if not plan.quantization:
        return {}
    found = [r for r in receipts if "scheme" in r]
    return {"scheme": plan.quantization["scheme"], "quantized": sum(r["quantized"] for r in found),
            "max_abs_error": max((r["max_abs_error"] for r in found), default=0.0),
            "max_error_vs_bound": max((r["max_error_vs_bound"] for r in found), default=0.0)}
