"""`verify` of a published model, wherever it lies: one pass over a `reader.ModelReader`, so a model on object
storage gets every check a local folder gets, with the same rows and wording (naming the file where it lies).

1. the manifest (`reader.check_manifest`): nothing beside the listed files (a folder), every small file's sha256;
2. the weight files, as the index names them (or the only one), before any is fetched;
3. given the checkpoint it was merged from: the files copied from its huggingface/ (`verify_copied_files`), and the
   tensor names the index maps against the checkpoint's;
4. each weight file in name order: its size and sha256 from its local copy (`reader.proven_copy`), then, given the
   checkpoint, the round trip of its tensors from those same bytes; its local copy goes before the next is fetched.

The first check that fails stops the pass (on object storage, later files are not fetched).

>>> [row["check"] for row in verify_model(model_reader("s3://models/run1"), manifest, source)]  # doctest: +SKIP
['manifest', 'copied files', 'round-trip']
"""

from __future__ import annotations

import hashlib
import json

from ..errors import CheckpointError, VerificationError
from ..formats import CheckpointSource
from ..model.card import CARD_FILE
from ..model.folder import copied_names
from ..model.manifest import MANIFEST_FILE, file_missing
from ..engine.plan import INDEX_FILE, output_config
from ..storage import checked_publishable, link_root
from ..storage.tensorio import INDEX_FILES, WEIGHT_SUFFIXES, SafetensorsFile, read_json, read_weight_map
from .quantized import quantized_errors
from .reader import ModelReader, check_manifest, proven_copy, weight_files
from .verify import manifest_plan, quantized_plan, round_trip_of, tensors_differ


def verify_model(reader: ModelReader, manifest: dict, source: CheckpointSource | None = None,
                 workers: int = 2) -> list[dict]:
    """The `verify` rows of the model `reader` reads, whose `manifest` was read already: "manifest", and given
    `source` (the checkpoint it was merged from, opened as its merge opened it: `api.merged_source`) "copied files"
    and "round-trip". A failed check raises its one-line error."""
    files: dict[str, dict] = manifest["files"]
    weights = weight_files(manifest)
    # the weight files' part of the manifest check comes below, each file's while its bytes are local
    results = [check_manifest(reader, manifest, deferred=weights)]
    layout = _weight_layout(reader, manifest, weights)
    aliases = manifest.get("aliases", {})
    plan = expected = None
    if source is not None:
        results.append(verify_copied_files(reader, source, manifest))
        plan = quantized_plan(source, manifest)
        expected = {t.name for t in plan.tensors} if plan else set(source.tensors()) - set(aliases)
        if None not in layout.values():  # names known from the index: fail before any weight file is fetched
            found = {name for names in layout.values() for name in names}
            if found != expected:
                raise tensors_differ(reader.place, found, expected)
            expected = None
    pieces, receipts = 0, []
    for name in weights:
        compared, errors = _verify_weight_file(reader, name, files[name], layout[name], source, aliases, workers,
                                               expected, plan)
        pieces += compared
        receipts.append(errors)
    if source is not None:
        results.append({"check": "round-trip", "tensors": len(source.tensors()), "pieces": pieces,
                        **(quantized_errors(plan, receipts) if plan else {}), "ok": True})
    return results


def _weight_layout(reader: ModelReader, manifest: dict, weights: list[str]) -> dict[str, set[str] | None]:
    """Tensor names per weight file, as the index says (None: the only weight file, its own header read later)."""
    index = next((name for name in INDEX_FILES if name in manifest["files"]), None)
    if index is None:
        if len(weights) != 1:
            raise CheckpointError(f"{reader.place}: {len(weights)} weight files and no index in {MANIFEST_FILE}; "
                                  "merge it again")
        return {weights[0]: None}
    weight_map = read_weight_map(reader.named_file(index))
    unnamed = sorted(set(weights) - set(weight_map.values()))
    if unnamed:
        raise CheckpointError(f"{reader.file(unnamed[0])}: a weight file that {index} does not name; merge it again "
                              "(it is not part of this model)")
    missing = sorted(set(weight_map.values()) - set(weights))
    if missing:
        raise file_missing(reader.file(missing[0]))
    return {file: {n for n, f in weight_map.items() if f == file} for file in weights}


def _verify_weight_file(reader: ModelReader, name: str, entry: dict, names: set[str] | None,
                        source: CheckpointSource | None, aliases: dict[str, str], workers: int,
                        expected: set[str] | None = None, plan=None) -> tuple[int, dict]:
    """Weight file `name`'s size and sha256, then its tensors against `source`; returns (the pieces compared, its
    quantized weights' errors: {} without any). Its local bytes go when this returns.

    `names`: the tensors the index maps to it (None: no index); `expected`: every output tensor, when this file
    (a model's only one, without an index) must hold them all; `plan`: a quantized merge's (`verify.quantized_plan`)."""
    where = reader.file(name)
    if not name.endswith(".safetensors"):
        raise CheckpointError(f"{where}: pickled weights are not read by verify; merge it again (ckptflow writes "
                              ".safetensors)")
    with proven_copy(reader, name, entry) as local:
        if source is None:
            return 0, {}
        try:
            weights = SafetensorsFile(local)
        except CheckpointError as error:
            raise CheckpointError(str(error).replace(str(local), str(where))) from None
        held = set(weights.keys())
        if names is not None and held != names:
            odd = sorted(held ^ names)
            raise CheckpointError(f"{where}: holds other tensors than the index maps to it ({', '.join(odd[:3])}); "
                                  "the folder was changed after it was written: merge again")
        if expected is not None and held != expected:
            raise tensors_differ(reader.place, held, expected)
        return round_trip_of(source, weights.get_tensor, held, aliases, plan, reader.place, workers, published=True)


def verify_copied_files(reader: ModelReader, source: CheckpointSource, manifest: dict) -> dict:
    """The files a merge copied from the source's huggingface/ (tokenizer, chat template, generation config...)
    are byte for byte the source's, none is missing or added, and config.json is what the merge writes from the
    source's (`engine.plan.output_config`: the source's config declaring the dtype written). A hash in the manifest
    proves only that a file did not change since the manifest was written; this ties them to the checkpoint.

    >>> verify_copied_files(model_reader("out/model"), merged_source, load_manifest("out/model"))["files"]  # doctest: +SKIP
    4
    """
    from ..formats.base import read_hf_config

    config = read_hf_config(source)  # first: a source whose huggingface/ is gone is a missing input, not a mismatch
    expected = copied_names(source)
    weights = {name for name in manifest["files"] if name.endswith(WEIGHT_SUFFIXES)}
    described = {name for name in manifest["files"] if "/" not in name and name not in weights
                 and name not in (INDEX_FILE, "config.json", CARD_FILE, MANIFEST_FILE)}
    odd = sorted(described ^ set(expected))
    if odd:
        raise VerificationError(f"{reader.place}: its copied files differ from {source.hf_dir}'s "
                                f"({', '.join(odd[:3])}); the folder was not merged from this checkpoint's "
                                "huggingface/ folder: merge again")
    for name in expected:
        with checked_publishable(source.hf_dir.join(name), link_root(source.hf_dir, source.location)) as theirs:
            if hashlib.sha256(theirs.read()).hexdigest() != reader.sha256(name):
                raise VerificationError(f"{reader.file(name)}: differs from {source.hf_dir.join(name)}; the copied "
                                        "file was changed after the merge: merge again")
    written = read_json(reader.named_file("config.json"), fix="merge again")
    if written != _expected_config(config, source, manifest):
        raise VerificationError(f"{reader.file('config.json')}: is not the config.json a merge writes from "
                                f"{source.hf_dir.join('config.json')}; it was changed after the merge: merge again")
    return {"check": "copied files", "files": len(expected) + 1, "ok": True}


def _expected_config(config: dict, source: CheckpointSource, manifest: dict) -> dict:
    """config.json as the merge recorded in `manifest` writes it from the source's `config`."""
    return json.loads(json.dumps(output_config(config, manifest_plan(source, config, manifest))))  # as written: JSON types
