"""Equivalence tests on the published folder."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import compare_logits, compare_with_reference, verify_manifest


@task(name="run_equivalence_tests", cache_policy=NO_CACHE)
def run_equivalence_tests(target: str, manifest: dict, reference: str | None = None,
                          trust_remote_code: bool = False) -> list[dict]:
    """With a reference: every tensor and the logits. The round-trip ran before publishing.

    A target reused from an earlier run is first checked against its manifest (sizes and times;
    `ckptflow verify` re-hashes everything).
    """
    folder = Path(target)
    results = list(manifest.get("verification", []))
    if manifest.get("reused"):
        results.append(verify_manifest(folder, full=False))
    if reference:
        tensors = compare_with_reference(folder, Path(reference))
        results.append({k: v for k, v in tensors.items() if k != "rows"})
        results.append(compare_logits(folder, Path(reference), trust_remote_code=trust_remote_code))
    return results
