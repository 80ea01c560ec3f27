"""Verifying a model on object storage file by file, by ranged reads: never a local copy of the whole model.

The checks and their wording are those of a local folder (`verify.verify_manifest`, `verify.verify_round_trip`):
every file the manifest lists has the size and sha256 it records, and, given the checkpoint, every shard of every
rank is found bit for bit in the output. Only the files the manifest lists are read (the visibility rule of
docs/remote_targets.md); objects beside them are not the model and are ignored.

Each weight file is fetched by ranged GETs into a sparse local file (`storage.RangeFile`, the FSDP reader's
machinery), hashed from those bytes, its tensors compared with the checkpoint while they are local, and then
released before the next file is fetched: peak local disk is one weight file, not the model. The other files
(config, index, tokenizer files, card, a LoRA adapter) are small and read whole into memory.

>>> source = open_checkpoint("s3://ckpts/run1/global_step_100/actor")              # doctest: +SKIP
>>> [r["check"] for r in verify_remote("s3://models/run1-step100", source)]       # doctest: +SKIP
['manifest', 'round-trip']
"""

from __future__ import annotations

import hashlib
import posixpath

from ..errors import CheckpointError
from ..formats import CheckpointSource
from ..targets.output import MANIFEST_FILE, sha256_file
from ..storage import Location, RangeFile
from ..targets import open_target
from ..storage.tensorio import INDEX_FILES, WEIGHT_SUFFIXES, SafetensorsFile, _weight_map
from .quantized import quantized_errors
from .verify import file_changed, file_missing, quantized_plan, round_trip_of, tensors_differ


def verify_remote(target: str | Location, source: CheckpointSource | None = None, manifest: dict | None = None,
                  workers: int = 2) -> list[dict]:
    """The `verify` result rows of the model at `target`: the manifest check, and the round trip when `source`
    (the checkpoint it was merged from, as merged: `merge.merge_view`) is given. Raises the same one-line
    errors as the local checks, naming the object's URL."""
    location = Location.of(target)
    manifest = manifest or open_target(location).require_manifest()
    files: dict[str, dict] = manifest["files"]
    weight_files = sorted(name for name in files if "/" not in name and name.endswith(WEIGHT_SUFFIXES))
    small = {name: _read_checked(location.join(name), entry)
             for name, entry in files.items() if name not in weight_files and name != MANIFEST_FILE}
    layout = _weight_layout(location, weight_files, small)
    aliases = manifest.get("aliases", {})
    plan = quantized_plan(source, manifest) if source is not None else None
    expected = None if source is None else {t.name for t in plan.tensors} if plan else set(source.tensors()) - set(aliases)
    if expected is not None and None not in layout.values():  # names known from the index: fail before any fetch
        found = {name for names in layout.values() for name in names}
        if found != expected:
            raise tensors_differ(location, found, expected)
        expected = None
    pieces, receipts = 0, []
    for name in weight_files:
        compared, errors = _verify_weight_file(location.join(name), files[name], layout[name], source, aliases,
                                               workers, expected, plan)
        pieces += compared
        receipts.append(errors)
    results = [{"check": "manifest", "files": len(files), "ok": True}]
    if source is not None:
        results.append({"check": "round-trip", "tensors": len(source.tensors()), "pieces": pieces,
                        **(quantized_errors(plan, receipts) if plan else {}), "ok": True})
    return results


class _Fetched:
    """A small file's bytes, read once, that `tensorio.read_json` can parse and name by URL."""

    def __init__(self, location: Location, data: bytes):
        self.location, self.data = location, data

    def read_text(self) -> str:
        return self.data.decode("utf-8")

    def __str__(self) -> str:
        return str(self.location)


def _read_checked(location: Location, entry: dict) -> _Fetched:
    try:
        data = location.read_bytes()
    except FileNotFoundError:
        raise file_missing(location) from None
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise file_changed(location)
    return _Fetched(location, data)


def _weight_layout(location: Location, weight_files: list[str], small: dict[str, _Fetched]) -> dict[str, set[str]]:
    """Tensor names per weight file, as the index says (or the only weight file's own header, read later)."""
    index = next((small[name] for name in INDEX_FILES if name in small), None)
    if index is None:
        if len(weight_files) != 1:
            raise CheckpointError(f"{location}: {len(weight_files)} weight files and no index in {MANIFEST_FILE}; "
                                  "merge it again")
        return {weight_files[0]: None}
    weight_map = _weight_map(index)
    unnamed = sorted(set(weight_files) - set(weight_map.values()))
    if unnamed:
        raise CheckpointError(f"{location.join(unnamed[0])}: a weight file that {posixpath.basename(str(index))} "
                              "does not name; merge it again (it is not part of this model)")
    missing = sorted(set(weight_map.values()) - set(weight_files))
    if missing:
        raise file_missing(location.join(missing[0]))
    return {file: {n for n, f in weight_map.items() if f == file} for file in weight_files}


def _verify_weight_file(location: Location, entry: dict, names: set[str] | None, source: CheckpointSource | None,
                        aliases: dict[str, str], workers: int, expected: set[str] | None = None,
                        plan=None) -> tuple[int, dict]:
    """Fetch one weight file by ranges, check its size and sha256, then its tensors against `source`; returns
    (the pieces compared, its quantized weights' errors: {} without any). Its local bytes go when this returns
    (the range file and its mapping are local here).

    `names`: the tensors the index maps to it (None: no index); `expected`: every output tensor, when this file
    (a model's only one, without an index) must hold them all; `plan`: a quantized merge's (`verify.quantized_plan`)."""
    if not location.name.endswith(".safetensors"):
        raise CheckpointError(f"{location}: pickled weights are not read from object storage; merge it again "
                              "(ckptflow writes .safetensors)")
    try:
        remote = RangeFile.of(location)
    except FileNotFoundError:
        raise file_missing(location) from None
    if remote.size != entry["size"]:
        raise file_changed(location)
    remote.fetch([(0, remote.size)])
    if sha256_file(remote.path) != entry["sha256"]:
        raise file_changed(location)
    if source is None:
        return 0, {}
    try:
        weights = SafetensorsFile(remote.path)
    except CheckpointError as error:
        raise CheckpointError(str(error).replace(remote.path, str(location))) from None
    held = set(weights.keys())
    if names is not None and held != names:
        odd = sorted(held ^ names)
        raise CheckpointError(f"{location}: holds other tensors than the index maps to it ({', '.join(odd[:3])}); "
                              "the folder was changed after it was written: merge again")
    if expected is not None and held != expected:
        raise tensors_differ(location.parent, held, expected)
    return round_trip_of(source, weights.get_tensor, held, aliases, plan, location.parent, workers, published=True)

