"""A merge assembled in a local folder: layer groups written at their offsets in pre-sized staged files, hashed
while the next groups merge, proven by the round trip, finished and published by one atomic rename."""

from __future__ import annotations

import os
from pathlib import Path

from ..engine.hashes import BackgroundHashes
from ..engine.merge import Prepared, Stopwatch, finish_folder, merge_group, write_beside_weights
from ..engine.fingerprints import metadata_id
from ..engine.writer import METADATA_SLACK, prepare_files, room_checked
from ..errors import CheckpointError
from ..model.folder import clear_strays
from ..proofs.verify import verify_round_trip
from ..targets.base import Staged
from ..targets.local import LocalTarget
from ..targets.publish import start_writeback
from .base import Assembly


class FolderAssembly(Assembly):
    target: LocalTarget

    def _staging_name(self) -> str:
        return str(self.target.staging)

    def _stage(self, prepared: Prepared, room: int) -> Staged:
        """The staging folder with the planned files pre-sized (`created`: made anew, so their groups must be
        written; files kept from an interrupted run keep theirs); refused first when they would not fit with
        `room` bytes for the rest."""
        staging = self.target.open_staging()
        return Staged(str(staging), created=prepare_files(prepared.plan, staging, room or METADATA_SLACK))

    def hashes(self, staged: Staged) -> BackgroundHashes:
        return BackgroundHashes(Path(staged.staging))  # the staged files, as far as their groups are written

    def write_unit(self, prepared: Prepared, group: str, staged: Staged, workers: int = 1, on_nonfinite: str = "warn",
                   on_tensor=None, chunk_bytes=None) -> dict:
        """Merge one layer group into its place in the staged files; returns its receipt (`merge.merge_group`)."""
        staging = Path(staged.staging)
        if not staging.is_dir():
            raise CheckpointError(f"{staging}: staging folder is gone and group {group} has no cached result; "
                                  "rerun with overwrite to rebuild the target")
        return merge_group(prepared.source, prepared.plan, group, staging, workers, on_tensor, on_nonfinite, chunk_bytes)

    def merge(self, prepared: Prepared, staged: Staged, *, overwrite: bool, verify: bool = True, workers: int = 2,
              on_unit=None, on_tensor=None, on_nonfinite: str = "warn", chunk_bytes=None, extra: dict | None = None,
              checks=None) -> dict:
        """Every group into the staged files, in order, then `finalize`. The weight files are hashed as far as
        they are written while the next groups merge."""
        clock, plan = Stopwatch(), prepared.plan
        with self.hashes(staged) as hashes:
            receipts = []
            for group in self.units(plan):
                receipts.append(self.write_unit(prepared, group, staged, workers, on_nonfinite, on_tensor, chunk_bytes))
                hashes.start_written(plan, {r["group"] for r in receipts})
                if on_unit:
                    on_unit(group, receipts[-1])
            clock.lap("merge")
            extra = {**(extra or {}), "timings": {**(extra or {}).get("timings", {}), **clock.laps}}
            return self.finalize(prepared, staged, receipts, overwrite=overwrite, verify=verify, workers=workers,
                                 extra=extra, hashes=hashes, checks=checks)

    def finalize(self, prepared: Prepared, staged: Staged, receipts: list[dict], *, overwrite: bool,
                 verify: bool = True, workers: int = 2, extra: dict | None = None, hashes=None, checks=None) -> dict:
        """Prove the staged files equal the shards (round trip), add index, config, copied files, card and
        manifest (`merge.finish_folder`, with `checks` of the finished folder), and publish atomically.
        Nothing reaches the target unless every check passed. `hashes`: a `BackgroundHashes` already through
        the groups merged so far."""
        staging, plan, clock = Path(staged.staging), prepared.plan, Stopwatch()
        with room_checked(staging):
            clear_strays(staging, set(plan.files))
            hashes = hashes or BackgroundHashes(staging)
            hashes.start(plan.files)  # finishes while the round-trip check runs
            descriptive = write_beside_weights(prepared, staging)
            start_writeback([staging / file for file in plan.files])  # to disk while the checks run; publish fsyncs
            results = [verify_round_trip(prepared.source, staging, plan.aliases, workers, plan)] if verify else []
            clock.lap("verify")
            extra = {**(extra or {}), "groups_written": receipts}
            extra["timings"] = {**extra.get("timings", {}), **clock.laps}
            manifest = finish_folder(prepared, staging, descriptive, results, extra, known=hashes.digests(), checks=checks)
            self.target.publish(staging, overwrite)
        return manifest

    def refresh(self, prepared: Prepared, *, verify: bool = True, workers: int = 2, checks=None) -> dict:
        """Reuse the weights the target holds, and republish only when config, tokenizer files or card changed —
        the weights hard-linked into a fresh staging folder, so the swap stays atomic and no weight byte is
        written."""
        manifest = self._held(prepared)
        if manifest.get("metadata_id") == metadata_id(prepared.source, prepared.config):
            return {**manifest, "reused": True}
        staging = self.target.open_staging(fresh=True)
        for file in prepared.plan.files:
            os.link(self.target.path / file, staging / file)
        return self.finalize(prepared, Staged(str(staging)), manifest.get("groups_written", []), overwrite=True,
                             verify=verify, workers=workers, checks=checks)
