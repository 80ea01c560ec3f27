"""Equivalence tests of the finished folder: the checks a promotion adds to the round trip (a reference model's
tensors and logits, the serving engine), before the publish on a new merge and afresh on a reused one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore.proofs.reader import check_published
from mergecore.proofs.verify import REFERENCE_CHECKS, reference_checks
from mergecore.serving import engine_check as prove_in_engine
from mergecore.targets import open_target

ENGINE_CHECKS = ("engine",)


@dataclass(frozen=True)
class FolderChecks:
    """What a promotion proves of the finished folder beyond the round trip: `reference` (its tensors and logits;
    `trust_remote_code` for the logits), `engine` ("vllm": loaded and run there, `engine_python` its interpreter)."""

    reference: str | None = None
    trust_remote_code: bool = False
    engine: str | None = None
    engine_python: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reference or self.engine)

    def __call__(self, folder: Path) -> list[dict]:
        rows = reference_checks(Path(folder), Path(self.reference), self.trust_remote_code) if self.reference else []
        if self.engine:
            rows.append(engine_check(str(folder), self.engine, self.engine_python))
        return rows

    def replaced(self) -> tuple[str, ...]:
        """The rows of an earlier run these checks make again."""
        return (REFERENCE_CHECKS if self.reference else ()) + (ENGINE_CHECKS if self.engine else ())


@task(name="engine_check", cache_policy=NO_CACHE)
def engine_check(folder: str, engine: str, engine_python: str | None = None) -> dict:
    """Load the finished folder in the engine that serves it (vLLM, in its own environment and process group) and
    compare every logprob it returns with transformers' on the same folder (mergecore.serving)."""
    return prove_in_engine(Path(folder), engine, engine_python)


@task(name="run_equivalence_tests", cache_policy=NO_CACHE)
def run_equivalence_tests(target: str, manifest: dict, checks: FolderChecks = FolderChecks()) -> list[dict]:
    """The checks of the published model. A new merge was proven before it was published (round-trip, and the
    `checks`): those results come from its manifest.

    A target reused from an earlier run is checked against its manifest (sizes, and times for a folder;
    `ckptflow verify` re-hashes everything) and the `checks` run on it afresh.
    """
    results = list(manifest.get("verification", []))
    if manifest.get("reused"):
        results = [r for r in results if r["check"] not in checks.replaced()]
        results.append(check_published(target, manifest))
        if checks:
            with open_target(target).local_copy() as folder:
                results += checks(folder)
    return results
