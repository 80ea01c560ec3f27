"""Content identities for caching and resume: what a group's output depends on, as a short hash.

A group's bytes depend on the files it reads (size + mtime/etag: cheap, no data read), its slice
of the plan (names, shapes, dtype, file offsets), where it is written, and the merge code itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from ..formats import CheckpointSource
from .plan import MergePlan


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# The modules whose code decides the bytes of a merged folder (readers, transforms, dtype casts, the plan,
# the writer, config/index output): a change to any of them invalidates cached groups. Everything else in
# mergecore (checks after the fact, the Hub, reports, error types) is listed in NOT_OUTPUT_CODE, so that
# editing it keeps finished groups; a test requires every module to be in exactly one of the two lists.
OUTPUT_CODE = (
    "formats/", "numbers/arrays.py", "numbers/budget.py", "numbers/dtypes.py", "families/layout.py",
    "families/megatron_maps.py", "families/registry.py", "families/transforms.py", "engine/plan.py", "engine/writer.py",
    "engine/remote_writer.py", "engine/merge.py", "model/folder.py", "model/adapter.py", "storage/locations.py",
    "storage/publishable.py", "storage/ranges.py", "views/hub_layout.py", "views/lora.py", "quantize/__init__.py",
    "quantize/kernels.py", "quantize/schemes.py", "quantize/stream.py",
    "families/meta_model.py", "families/torchtitan_maps.py",
)
NOT_OUTPUT_CODE = (
    "__init__.py", "api.py", "request.py", "errors.py", "hub.py", "describe.py", "picture.py", "engine/__init__.py",
    "engine/fingerprints.py", "engine/hashes.py", "model/__init__.py", "model/card.py", "model/manifest.py",
    "families/__init__.py", "families/config_check.py", "numbers/__init__.py", "numbers/claims.py",
    "numbers/nonfinite.py", "proofs/__init__.py", "proofs/remote_verify.py", "proofs/verify.py", "storage/ledger.py",
    "storage/__init__.py", "storage/retries.py", "storage/tensorio.py", "targets/__init__.py", "targets/base.py",
    "targets/local.py", "targets/lock.py", "targets/publish.py", "targets/remote.py", "views/__init__.py",
    "proofs/quantized.py", "proofs/published.py", "proofs/reader.py", "assembly/__init__.py", "assembly/base.py",
    "assembly/folder.py", "assembly/object_storage.py", "serving/__init__.py", "serving/check.py",
    "serving/environment.py", "serving/vllm_probe.py",
)
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # mergecore/


def output_code_files(root: Path) -> list[Path]:
    """The files of OUTPUT_CODE under a mergecore tree, in a stable order."""
    selected = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(entry) if entry.endswith("/") else relative == entry for entry in OUTPUT_CODE):
            selected.append(path)
    return selected


def code_version(root: Path | None = None) -> str:
    """Hash of the merge code that produces output bytes (OUTPUT_CODE), for cache keys.

    >>> code_version() == code_version(PACKAGE_ROOT)
    True
    """
    return _code_version(Path(root) if root is not None else PACKAGE_ROOT)


@lru_cache(maxsize=4)
def _code_version(root: Path) -> str:
    files = output_code_files(root)
    return digest({p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})[:16]


def input_fingerprints(source: CheckpointSource, names=None) -> dict[str, dict]:
    found = {str(location): location.fingerprint() for location in source.input_files(names)}
    lora = getattr(source, "identity", None)  # a fused LoRA merge also depends on alpha, r and its outputs
    return {**found, "lora": lora} if lora else found


def unit_key(source: CheckpointSource, plan: MergePlan, unit: str, where: str | Path) -> str:
    """Cache key of one unit's merge (a layer group into staged files, or an output file written whole to object
    storage: `MergePlan.units`): equal keys mean equal bytes already at `where` (the staging folder, the target)."""
    return _tensors_key(source, plan, plan.in_unit(unit), where)


def _tensors_key(source: CheckpointSource, plan: MergePlan, planned: list, where: str | Path) -> str:
    names = list(dict.fromkeys(t.source_name or t.name for t in planned))  # a quantized weight: its checkpoint tensor
    names += [dropped for dropped, kept in plan.aliases.items() if kept in names]  # checked against it
    return digest({
        "inputs": input_fingerprints(source, names),
        "group": [asdict(t) for t in planned],
        "dtype": plan.dtype,
        "code": code_version(),
        "staging": str(where),
    })


def weights_id(source: CheckpointSource, plan: MergePlan) -> str:
    """Identity of the merged weight files: same inputs, same plan, same code."""
    return digest({"inputs": input_fingerprints(source), "plan": asdict(plan), "code": code_version()})


def metadata_id(source: CheckpointSource, config: dict) -> str:
    """Identity of everything else in the folder: config.json and the files copied from huggingface/."""
    files = {name: source.hf_dir.join(name).fingerprint() for name in source.hf_dir.listdir()}
    lora = getattr(source, "identity", None)
    return digest({"config": config, "files": files, "code": code_version(), **({"lora": lora} if lora else {})})
