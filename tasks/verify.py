"""Equivalence tests on the published folder."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore.proofs.reader import check_published
from mergecore.proofs.verify import REFERENCE_CHECKS, reference_checks
from mergecore.targets import open_target


@task(name="run_equivalence_tests", cache_policy=NO_CACHE)
def run_equivalence_tests(target: str, manifest: dict, reference: str | None = None,
                          trust_remote_code: bool = False) -> list[dict]:
    """The checks of the published model. A new merge was proven before it was published (round-trip,
    and with a reference its tensors and logits): those results come from its manifest.

    A target reused from an earlier run is checked against its manifest (sizes, and times for a folder;
    `ckptflow verify` re-hashes everything) and, with a reference, compared with it afresh.
    """
    results = list(manifest.get("verification", []))
    if manifest.get("reused"):
        results = [r for r in results if not reference or r["check"] not in REFERENCE_CHECKS]
        results.append(check_published(target, manifest))
        if reference:
            with open_target(target).local_copy() as folder:
                results += reference_checks(folder, Path(reference), trust_remote_code)
    return results
