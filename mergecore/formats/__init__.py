"""Find the checkpoint behind a path and open it with the right format reader.

Accepted: a role folder (`.../global_step_N/actor`), a `global_step_N` folder (role `actor` unless
told otherwise) or a run root holding `latest_checkpointed_iteration.txt`.
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..storage import Location, publishable_hf_files
from .base import CheckpointSource, Piece, TensorInfo
from .detect import (ACCELERATE_MODEL_DIR, TORCHTITAN_STEP_DIR, has_dcp, has_dist_ckpt, has_mp_rank_folders,
                     has_rank_files)

__all__ = ["CheckpointSource", "Piece", "TensorInfo", "open_checkpoint", "find_role_folder"]

STEP_FOLDER = re.compile(r"^global_step_(\d+)$")
LATEST_FILE = "latest_checkpointed_iteration.txt"

# backend name -> (test on a folder's entry names and the folder, reader class as "module:Class").
# Readers are imported only when chosen: the Megatron ones need torch, the FSDP one does not.
FORMATS = {
    "fsdp": (has_rank_files, "fsdp:FsdpCheckpoint"),
    "megatron_legacy": (has_mp_rank_folders, "megatron.legacy:MegatronLegacyCheckpoint"),
    "megatron_dist": (has_dist_ckpt, "megatron.dist:MegatronDistCheckpoint"),
    "dcp": (has_dcp, "dcp:DcpCheckpoint"),
}
# --backend values: verl's `megatron` covers both of its Megatron layouts (dist_ckpt is its default).
BACKENDS = {"fsdp": ("fsdp",), "megatron": ("megatron_legacy", "megatron_dist"),
            "megatron_legacy": ("megatron_legacy",), "megatron_dist": ("megatron_dist",), "dcp": ("dcp",)}


def reader_class(backend: str) -> type[CheckpointSource]:
    import importlib

    module, name = FORMATS[backend][1].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def _is_checkpoint(names: list[str], folder: Location) -> bool:
    return any(test(names, folder) for test, _ in FORMATS.values())


def find_role_folder(location: Location, role: str = "actor") -> tuple[Location, int | None]:
    """Resolve a run root / step folder / role folder to the role folder and its step."""
    names = location.listdir()
    if not names and not location.exists():
        raise CheckpointError(f"{location}: does not exist; check the path (local path or fsspec URL)")
    step_match = STEP_FOLDER.match(location.name)
    if _is_checkpoint(names, location):
        parent = STEP_FOLDER.match(location.parent.name) or TORCHTITAN_STEP_DIR.match(location.name)
        return location, int(parent[1]) if parent else None
    accelerate = sorted(n for n in names if ACCELERATE_MODEL_DIR.match(n))
    if accelerate:  # Accelerate's save_state: the model's DCP folder beside optimizer_0/ and the RNG pickles
        return find_role_folder(location.join(accelerate[0]), role)
    titan_steps = sorted((int(m[1]), n) for n in (location.join("checkpoint").listdir() if "checkpoint" in names
                                                  else []) if (m := TORCHTITAN_STEP_DIR.match(n)))
    if titan_steps:  # torchtitan's run folder: the newest step
        return find_role_folder(location.join("checkpoint", titan_steps[-1][1]), role)
    if step_match:
        if role not in names:
            raise CheckpointError(f"{location}: has no {role}/ folder (found: {', '.join(names) or 'nothing'}); pass --role")
        return location.join(role), int(step_match[1])
    if LATEST_FILE in names:
        text = location.join(LATEST_FILE).read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{location.join(LATEST_FILE)}: holds {text!r}, not a step number")
        return find_role_folder(location.join(f"global_step_{text}"), role)
    steps = sorted((int(m[1]), n) for n in names if (m := STEP_FOLDER.match(n)))
    if steps:
        return find_role_folder(location.join(steps[-1][1]), role)
    raise CheckpointError(
        f"{location}: no checkpoint found (expected model_world_size_W_rank_R.pt files, model/mp_rank_* folders, "
        f"global_step_N folders, {LATEST_FILE}, or a torch distributed checkpoint: .metadata and __R_K.distcp "
        "files); point --local_dir at the actor folder of a verl checkpoint or the folder of a DCP save"
    )


def open_checkpoint(
    path: str | Location,
    role: str = "actor",
    backend: str = "auto",
    hf_dir: str | None = None,
    custom_mapping: str | None = None,
) -> CheckpointSource:
    """Discover a checkpoint and return its reader; nothing heavy is read yet.

    >>> ckpt = open_checkpoint("checkpoints/run1", role="actor")  # doctest: +SKIP
    >>> ckpt.describe()["world_size"]                               # doctest: +SKIP
    4
    """
    if backend != "auto" and backend not in BACKENDS:
        raise CheckpointError(f"--backend {backend} is not supported; use one of: auto, {', '.join(BACKENDS)}")
    folder, step = find_role_folder(Location.of(path), role)
    names = folder.listdir()
    for name in FORMATS if backend == "auto" else BACKENDS[backend]:
        if FORMATS[name][0](names, folder):
            options = {"custom_mapping": custom_mapping} if custom_mapping else {}
            if options and name in ("fsdp", "dcp"):
                raise CheckpointError(f"{folder}: --custom-mapping applies to Megatron checkpoints; this one keeps "
                                      "Hugging Face names")
            source = reader_class(name)(folder, Location.of(hf_dir) if hf_dir else None, step=step, **options)
            source.backend = name
            publishable_hf_files(source.hf_dir, source.location)  # refuses links out, FIFOs, devices: before any write
            return source
    raise CheckpointError(f"{folder}: is not a {backend} checkpoint; try --backend auto")
