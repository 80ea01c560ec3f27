"""One output file streamed straight to object storage, then read back and proven equal to the shards.

Object stores take whole objects, not writes at offsets, so a remote target is written a file at a time
instead of a group at a time: the plan fixes the file's header and every tensor's place in it, so the
header and then the tensors, in order, in row blocks, go out as one upload (s3fs sends it as a multipart
upload in blocks: memory holds a block, and the object appears whole or not at all). Any machine can
write any file; nothing is assembled on local disk.

>>> receipt = write_remote_file(source, plan, "model-00001-of-00004.safetensors", "s3://models/run1")  # doctest: +SKIP
>>> receipt["sha256"], receipt["pieces"]                                                                # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import time

from ..errors import VerificationError
from ..formats import CheckpointSource
from ..numbers.budget import in_flight
from ..numbers.nonfinite import checked_blocks
from ..quantize.schemes import scheme_of
from ..quantize.stream import quantized_blocks
from ..storage import Location, RangeFile, fingerprint_of
from .plan import MergePlan
from .writer import tensor_bytes


def write_remote_file(source: CheckpointSource, plan: MergePlan, file: str, target: str | Location, *,
                      on_nonfinite: str = "warn", chunk_bytes: int | str | None = None, prove=None,
                      on_tensor=None) -> dict:
    """Stream planned `file` to `target/file`, then (with `prove`, e.g. `proofs.remote_verify.check_stored_file`:
    the proofs sit above the engine, so the caller hands them down) read the stored object back and prove it
    against every rank's shard: `prove(source, plan, file, location, stored, sha256) -> (pieces, errors)`.

    Returns a receipt: the file, its tensors and bytes, the sha256 and size of the stored object and its
    storage identity (size + ETag), the pieces compared, and non-finite counts when `on_nonfinite="warn"`
    wrote some. With `on_nonfinite="fail"` the first NaN/Inf raises CheckpointError and no object appears.
    """
    from ..numbers.budget import chunk_bytes as budget_of
    from ..numbers.nonfinite import check_nonfinite_policy

    check_nonfinite_policy(on_nonfinite)
    started, budget = time.perf_counter(), budget_of(chunk_bytes)
    location = Location.of(target).join(file)
    fs, path = location.fs_path
    planned = sorted(plan.in_file(file), key=lambda t: t.begin)
    sent = hashlib.sha256()
    # from remote rank files: the bytes of this file's tensors only (a quantized part's: its weight's), in one batch
    source.prefetch(list(dict.fromkeys(t.source_name or t.name for t in planned)))
    out = fs.open(path, "wb")
    try:
        position, nonfinite = _stream(source, plan, file, planned, out, sent, on_nonfinite, budget, on_tensor)
    except BaseException:
        abandon(out)
        raise
    out.close()  # completes the upload: the object appears, whole
    stored = location.fresh_info()
    receipt = {"file": file, "groups": sorted({t.group for t in planned}, key=plan.groups.index),
               "tensors": len(planned), "bytes": position, "size": int(stored["size"]),
               "sha256": sent.hexdigest(), "identity": fingerprint_of(stored)}
    if prove:
        receipt["pieces"], errors = prove(source, plan, file, location, stored, receipt["sha256"])
        receipt.update(errors)
    receipt["seconds"] = round(time.perf_counter() - started, 3)
    return {**receipt, "nonfinite": nonfinite} if nonfinite else receipt


def _stream(source, plan, file, planned, out, sent, on_nonfinite, budget, on_tensor) -> tuple[int, dict]:
    """Write the header and then every planned tensor of `file`, in order, to `out`; returns (data bytes written,
    non-finite counts per tensor)."""
    nonfinite, held = {}, {}
    header = plan.header(file)
    out.write(header)
    sent.update(header)
    position = 0
    for entry in planned:
        if entry.begin != position:
            raise AssertionError(f"{file}: the plan leaves bytes {position}..{entry.begin} unassigned")
        for data in _entry_bytes(source, plan, entry, budget, on_nonfinite, nonfinite, held):  # bytes in order
            out.write(data)
            sent.update(data)
            position += len(data)
            del data
        if position != entry.end:
            raise AssertionError(f"{entry.name}: wrote up to byte {position} of {file}, planned {entry.end}")
        if on_tensor:
            on_tensor(entry.name)
    return position, nonfinite


def _entry_bytes(source, plan, entry, budget, on_nonfinite: str, found: dict, held: dict):
    """The bytes of planned tensor `entry`, in file order, block by block. A quantized weight's parts all come from
    one pass over its rows (`quantize.stream.quantized_blocks`, run when its primary part comes): the primary's
    blocks are sent as they come, the small parts (scales, shape) kept in `held` until their turn, which the plan
    puts right after the primary in the same file."""
    if entry.part is None:
        for _, block in in_flight(checked_blocks(source, entry, budget, on_nonfinite, found)):
            yield tensor_bytes(block)
        return
    if entry.name in held:
        yield from held.pop(entry.name)
        return
    if entry.part != scheme_of(plan.quantization).primary:
        raise AssertionError(f"{entry.name}: planned before its weight's {scheme_of(plan.quantization).primary}")
    for part, _, block in in_flight(quantized_blocks(source, plan, entry, budget, on_nonfinite)):
        if part.name == entry.name:
            yield tensor_bytes(block)
        else:
            held.setdefault(part.name, []).append(tensor_bytes(block))


def abandon(out) -> None:
    """Drop an unfinished upload: fsspec's files complete it on close (a truncated object under the final
    name); `discard` aborts a multipart upload (s3fs) and drops the buffer, and a closed file is never flushed."""
    try:
        out.discard()
    finally:
        out.closed = True
