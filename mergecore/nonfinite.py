"""What to do about NaN/Inf in converted weights (found by `arrays.nonfinite_counts` while merging):
`fail` refuses the merge, `warn` publishes and lists each tensor with its counts in its group's receipt.

>>> describe_counts({"nan": 1, "+inf": 2, "-inf": 0})
'1 NaN, 2 +Inf'
"""

from __future__ import annotations

from .errors import CheckpointError

NONFINITE_POLICIES = ("fail", "warn")


def check_nonfinite_policy(on_nonfinite: str) -> None:
    if on_nonfinite not in NONFINITE_POLICIES:
        raise CheckpointError(f"--on-nonfinite {on_nonfinite!r}: choose one of {', '.join(NONFINITE_POLICIES)}")


def nonfinite_error(found: dict[str, dict[str, int]], source) -> CheckpointError:
    """The one-line refusal of non-finite weights: the first tensor, its counts, where it came from, the fix."""
    name, counts = next(iter(found.items()))
    more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
    return CheckpointError(
        f"{name} in {source}: {describe_counts(counts)} after conversion{more}; training may have diverged "
        "(or values overflow the output dtype): pick an earlier checkpoint, or pass --on-nonfinite warn to publish anyway"
    )


def describe_counts(counts: dict[str, int]) -> str:
    """`{"nan": 1, "+inf": 2, "-inf": 0}` -> `"1 NaN, 2 +Inf"`."""
    labels = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}
    return ", ".join(f"{n} {labels[kind]}" for kind, n in counts.items() if n)


def nonfinite_found(receipts: list[dict]) -> dict[str, dict[str, int]]:
    """{tensor: counts} over the receipts of merge_group (fresh or cached), in plan order."""
    return {name: counts for receipt in receipts for name, counts in receipt.get("nonfinite", {}).items()}
