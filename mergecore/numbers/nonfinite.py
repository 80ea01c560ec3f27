"""What to do about NaN/Inf in converted weights (found by `arrays.nonfinite_counts` while merging):
`fail` refuses the merge, `warn` publishes and lists each tensor with its counts in its group's receipt. (A
quantized merge defaults to `fail`, and with `warn` publishes such weights unquantized: `mergecore.request`,
`quantize.stream`.)

>>> describe_counts({"nan": 1, "+inf": 2, "-inf": 0})
'1 NaN, 2 +Inf'
"""

from __future__ import annotations

from .arrays import FLOATING, nonfinite_counts
from ..errors import CheckpointError

NONFINITE_POLICIES = ("fail", "warn")


def check_nonfinite_policy(on_nonfinite: str) -> None:
    if on_nonfinite not in NONFINITE_POLICIES:
        raise CheckpointError(f"--on-nonfinite {on_nonfinite!r}: choose one of {', '.join(NONFINITE_POLICIES)}")


PUBLISH_ANYWAY = ("training may have diverged (or values overflow the output dtype): pick an earlier checkpoint, "
                  "or pass --on-nonfinite warn to publish anyway")


def nonfinite_error(found: dict[str, dict[str, int]], source, fix: str = PUBLISH_ANYWAY) -> CheckpointError:
    """The one-line refusal of non-finite weights: the first tensor, its counts, where it came from, the fix (a
    quantized weight's is its own: `quantize.stream.QUANTIZED_NONFINITE_FIX`)."""
    name, counts = next(iter(found.items()))
    more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
    return CheckpointError(f"{name} in {source}: {describe_counts(counts)} after conversion{more}; {fix}")


def describe_counts(counts: dict[str, int]) -> str:
    """`{"nan": 1, "+inf": 2, "-inf": 0}` -> `"1 NaN, 2 +Inf"`."""
    labels = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}
    return ", ".join(f"{n} {labels[kind]}" for kind, n in counts.items() if n)


def nonfinite_found(receipts: list[dict]) -> dict[str, dict[str, int]]:
    """{tensor: counts} over the receipts of merge_group (fresh or cached), in plan order."""
    return {name: counts for receipt in receipts for name, counts in receipt.get("nonfinite", {}).items()}


def checked_blocks(source, entry, budget: int | None, on_nonfinite: str, found: dict):
    """`source.row_blocks` of planned tensor `entry`, in order, each checked for NaN/Inf as converted (so fp16
    overflow counts too): with `on_nonfinite="fail"` the first raises CheckpointError; otherwise the counts
    add up in `found[entry.name]`.

    >>> for start, block in checked_blocks(source, entry, 64 << 20, "warn", found): ...  # doctest: +SKIP
    """
    for start, block in source.row_blocks(entry.name, entry.dtype, budget):
        counts = nonfinite_counts(block) if entry.dtype in FLOATING else None
        if counts and on_nonfinite == "fail":
            raise nonfinite_error({entry.name: counts}, source.location)
        if counts:
            found[entry.name] = add_counts(found.get(entry.name), counts)
        yield start, block
        del block  # not held while the next block is read


def add_counts(total: dict[str, int] | None, more: dict[str, int] | None) -> dict[str, int] | None:
    """Non-finite counts of two row blocks together (None: all finite)."""
    if not (total and more):
        return total or more
    return {kind: total[kind] + more[kind] for kind in total}
