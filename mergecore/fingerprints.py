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

from .formats import CheckpointSource
from .plan import MergePlan


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of mergecore's own source: changing the merge code invalidates cached groups."""
    root = Path(__file__).parent
    sources = sorted(root.rglob("*.py"))
    return digest({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sources})[:16]


def input_fingerprints(source: CheckpointSource, names=None) -> dict[str, dict]:
    return {str(location): location.fingerprint() for location in source.input_files(names)}


def group_key(source: CheckpointSource, plan: MergePlan, group: str, staging: str | Path) -> str:
    """Cache key of one group's merge: equal keys mean equal bytes already at `staging`."""
    names = [t.name for t in plan.in_group(group)]
    names += [dropped for dropped, kept in plan.aliases.items() if kept in names]  # checked against it
    return digest({
        "inputs": input_fingerprints(source, names),
        "group": [asdict(t) for t in plan.in_group(group)],
        "dtype": plan.dtype,
        "code": code_version(),
        "staging": str(staging),
    })


def weights_id(source: CheckpointSource, plan: MergePlan) -> str:
    """Identity of the merged weight files: same inputs, same plan, same code."""
    return digest({"inputs": input_fingerprints(source), "plan": asdict(plan), "code": code_version()})


def metadata_id(source: CheckpointSource, config: dict) -> str:
    """Identity of everything else in the folder: config.json and the files copied from huggingface/."""
    files = {name: source.hf_dir.join(name).fingerprint() for name in source.hf_dir.listdir()}
    return digest({"config": config, "files": files, "code": code_version()})
