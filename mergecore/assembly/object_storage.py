"""A merge assembled on object storage: each weight file streamed to its final name, read back and proven against
the shards, and recorded (any machine can write any file); then the rest of the folder goes up and the manifest
last publishes the model (the target's rules: `mergecore.targets.remote`)."""

from __future__ import annotations

import posixpath
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.fingerprints import weights_id
from ..engine.merge import Prepared, finish_folder, write_beside_weights
from ..engine.remote_writer import write_remote_file
from ..errors import VerificationError
from ..proofs.quantized import quantized_errors
from ..proofs.remote_verify import check_stored_file
from ..targets.base import Staged
from ..targets.remote import RemoteTarget
from .base import Assembly


class ObjectStorageAssembly(Assembly):
    target: RemoteTarget

    def _stage(self, prepared: Prepared, room: int) -> Staged:
        """The run's marker names the planned weight files before anything is written; files an interrupted run
        of this very merge finished are kept (`RemoteTarget.begin_run`)."""
        plan = prepared.plan
        return self.target.begin_run(weights_id(prepared.source, plan), {f: plan.file_size(f) for f in plan.files})

    def write_unit(self, prepared: Prepared, file: str, staged: Staged, workers: int = 1, on_nonfinite: str = "warn",
                   on_tensor=None, chunk_bytes=None, verify: bool = True) -> dict:
        """Write, check and record one weight file of `prepared`'s plan (see `remote_writer`)."""
        self.target.claim([file], staged)  # named by this merge's marker (at staging) before its object is written
        receipt = write_remote_file(prepared.source, prepared.plan, file, self.target.location,
                                    on_nonfinite=on_nonfinite, chunk_bytes=chunk_bytes,
                                    prove=check_stored_file if verify else None, on_tensor=on_tensor)
        self.target.record(file, staged, receipt)
        return receipt

    def merge(self, prepared: Prepared, staged: Staged, *, overwrite: bool, verify: bool = True, workers: int = 2,
              on_unit=None, on_tensor=None, on_nonfinite: str = "warn", chunk_bytes=None, extra: dict | None = None,
              checks=None) -> dict:
        """The files left to write, `workers` at a time (each streamed, read back and checked), then `finalize`."""

        def one(file: str) -> dict:
            receipt = self.write_unit(prepared, file, staged, 1, on_nonfinite, on_tensor, chunk_bytes, verify)
            if on_unit:
                on_unit(file, receipt)
            return receipt

        with ThreadPoolExecutor(max(1, workers)) as pool:
            written = {r["file"]: r for r in pool.map(one, staged.created)}
        receipts = [staged.kept.get(f) or written[f] for f in prepared.plan.files]
        return self.finalize(prepared, staged, receipts, overwrite=overwrite, verify=verify, extra=extra, checks=checks)

    def finalize(self, prepared: Prepared, staged: Staged, receipts: list[dict], *, overwrite: bool = False,
                 verify: bool = True, workers: int = 2, extra: dict | None = None, hashes=None, checks=None) -> dict:
        """Publish the weight files written (one receipt each): they are still the ones written; index, config,
        copied files, a LoRA adapter and the card go up; objects of an earlier model and the staging records go;
        the manifest is written last. `checks(folder)` (a reference's tensors and logits) runs on a local copy
        before anything is published."""
        published = self.published(prepared)
        if published:
            return {**published, "reused": True}
        plan, target = prepared.plan, self.target
        by_file = {r["file"]: r for r in receipts}
        for file in plan.files:
            if file not in by_file or target.stored_identity(file) != by_file[file]["identity"]:
                raise VerificationError(f"{target.location.join(file)}: not the file this merge wrote (missing or "
                                        "replaced since); nothing was published: merge again")
        results = [{"check": "round-trip", "tensors": len(prepared.source.tensors()),
                    "pieces": sum(by_file[f]["pieces"] for f in plan.files),
                    **quantized_errors(plan, [by_file[f] for f in plan.files]), "ok": True}] if verify else []
        stored = {f: {"sha256": by_file[f]["sha256"], "size": by_file[f]["size"]} for f in plan.files}
        with tempfile.TemporaryDirectory(prefix="ckptflow-publish-") as scratch:
            folder = Path(scratch)
            descriptive = write_beside_weights(prepared, folder)
            if checks:  # they read the weights: a local copy, removed before the upload
                fs, root = target.location.fs_path
                for file in plan.files:
                    fs.get_file(posixpath.join(root, file), str(folder / file))
            manifest = finish_folder(prepared, folder, descriptive, results, {**(extra or {}), "groups_written": receipts},
                                     stored=stored, checks=checks)
            for file in plan.files:
                (folder / file).unlink(missing_ok=True)
            target.publish_folder(folder, keep=set(plan.files), staged=staged)
        return manifest

    def refresh(self, prepared: Prepared, *, verify: bool = True, workers: int = 2, checks=None) -> dict:
        """The target holds this merge: reused as it is."""
        return {**self._held(prepared), "reused": True}
