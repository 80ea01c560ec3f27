"""What every assembly does the same way: the checks before staging, whether the target already holds this very
merge, and which units are written (the plan says which units exist; the target, which kind it takes)."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

from ..engine.fingerprints import weights_id
from ..engine.merge import Prepared
from ..errors import CheckpointError, VerificationError
from ..proofs.reader import check_published
from ..targets import Target
from ..targets.base import Staged, check_apart


class Assembly:
    """A merge assembled at one target (`target`); subclasses say how units are written and the model finished."""

    def __init__(self, target: Target):
        self.target = target

    @property
    def url(self) -> str:
        return self.target.url

    @property
    def unit(self) -> str:
        return self.target.unit

    def lock(self) -> AbstractContextManager:
        return self.target.lock()

    def units(self, plan) -> list[str]:
        """The units of `plan` this target is written in, each by one `write_unit` (`MergePlan.units`)."""
        return plan.units(self.unit)

    def rewritten(self, plan, staged: Staged) -> set[str]:
        """The units to write again, whatever a cache holds: those of the files `stage` must write anew."""
        created = set(staged.created)
        return {unit for unit in self.units(plan) if any(t.file in created for t in plan.in_unit(unit))}

    def hashes(self, staged: Staged) -> AbstractContextManager:
        """What hashes the weight files while units are written (None where each file is hashed as it streams)."""
        return nullcontext()

    def stage(self, prepared: Prepared, overwrite: bool, room: int = 0, sources: Iterable[str] = ()) -> Staged:
        """Where the merge `prepared` writes. This is the check under the lock, so it is the one that counts: the
        target overlaps no checkpoint folder (`sources`, the checkpoint read, its huggingface/), a crash's leftovers
        of an earlier publish are repaired, and the target is empty, ckptflow's unfinished merge or (with
        `overwrite`) its model. `published` (nothing to write) when the target already holds this very merge,
        whatever `overwrite` says; else the staged place, with `created` listing what must be written anew."""
        for source in [*sources, str(prepared.source.location), str(prepared.source.hf_dir)]:
            check_apart(self.url, source)
        self.target.repair()
        if self.published(prepared, overwrite):
            return Staged(self._staging_name(), published=True, weights_id=weights_id(prepared.source, prepared.plan))
        self.target.check_replaceable(overwrite)
        return self._stage(prepared, room)

    def published(self, prepared: Prepared, overwrite: bool = False) -> dict | None:
        """The manifest when the target already holds exactly this merge (same inputs, plan and code). With
        `overwrite` the files must also pass `check_published` — the same check a rerun reports — so a model
        damaged since it was published is rebuilt, not kept."""
        manifest = self.target.manifest()
        if manifest is None or manifest.get("weights_id") != weights_id(prepared.source, prepared.plan):
            return None
        if overwrite:
            try:
                check_published(self.url, manifest)
            except (VerificationError, CheckpointError):
                return None
        return manifest

    def _staging_name(self) -> str:
        return self.url

    def _stage(self, prepared: Prepared, room: int) -> Staged:
        raise NotImplementedError

    def write_unit(self, prepared: Prepared, unit: str, staged: Staged, workers: int = 1, on_nonfinite: str = "warn",
                   on_tensor=None, chunk_bytes=None) -> dict:
        """Merge one unit of `prepared`'s plan into the staged place; returns its receipt."""
        raise NotImplementedError

    def merge(self, prepared: Prepared, staged: Staged, *, overwrite: bool, verify: bool = True, workers: int = 2,
              on_unit=None, on_tensor=None, on_nonfinite: str = "warn", chunk_bytes=None, extra: dict | None = None,
              checks=None) -> dict:
        """Every unit left to write, then `finalize`; returns the manifest."""
        raise NotImplementedError

    def finalize(self, prepared: Prepared, staged: Staged, receipts: list[dict], *, overwrite: bool,
                 verify: bool = True, workers: int = 2, extra: dict | None = None, hashes=None, checks=None) -> dict:
        """Prove what the units wrote, add what a model holds beside its weights, and publish."""
        raise NotImplementedError

    def refresh(self, prepared: Prepared, *, verify: bool = True, workers: int = 2, checks=None) -> dict:
        """The target holds this merge (`stage` said `published`): reuse it."""
        raise NotImplementedError

    def _held(self, prepared: Prepared) -> dict:
        """The manifest of the merge the target holds (`refresh` is for that case only)."""
        manifest = self.published(prepared, overwrite=False)
        if manifest is None:
            raise CheckpointError(f"{self.url}: does not hold this checkpoint's merge; rerun with overwrite to rebuild it")
        return manifest
