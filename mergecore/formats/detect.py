"""Which format a role folder holds, from its entry names alone (no format module, no torch, imported)."""

from __future__ import annotations

import re

from ..storage import Location

FSDP_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
MP_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
DIST_DIR = "dist_ckpt"
DIST_METADATA_FILE = ".metadata"
DCP_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
ACCELERATE_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_\d+$")  # Accelerate's save_state with FSDP
TORCHTITAN_STEP_DIR = re.compile(r"^step-(\d+)$")  # torchtitan: RUN/checkpoint/step-N


def has_rank_files(names: list[str], folder: Location | None = None) -> bool:
    """A verl FSDP role folder: `model_world_size_W_rank_R.pt` files."""
    return any(FSDP_RANK_FILE.match(n) for n in names)


def has_mp_rank_folders(names: list[str], folder: Location | None = None) -> bool:
    """A role folder holding `model/mp_rank_*` folders (only `model/` is checked without `folder`)."""
    if "model" not in names:
        return False
    if folder is None:
        return True
    return any(MP_RANK_DIR.match(n) for n in folder.join("model").listdir())


def dist_ckpt_dir(folder: Location, names: list[str] | None = None) -> Location | None:
    """The dist_ckpt folder of a role folder: `model/dist_ckpt` (verl 0.9.1) or `dist_ckpt` (older)."""
    names = folder.listdir() if names is None else names
    candidates = []
    if "model" in names:
        candidates.append(folder.join("model", DIST_DIR))
    if DIST_DIR in names:
        candidates.append(folder.join(DIST_DIR))
    for candidate in candidates:
        if candidate.join(DIST_METADATA_FILE).exists() or candidate.join("metadata.json").exists():
            return candidate
    return None


def has_dist_ckpt(names: list[str], folder: Location | None = None) -> bool:
    """A role folder holding a Megatron dist_ckpt (`model/dist_ckpt/` or `dist_ckpt/`)."""
    if folder is None:
        return DIST_DIR in names
    if DIST_DIR not in names and "model" not in names:
        return False
    return dist_ckpt_dir(folder, names) is not None


def has_dcp(names: list[str], folder: Location | None = None) -> bool:
    """A torch distributed checkpoint of a model saved by torch's own `dcp.save` (torchtitan, Accelerate, any FSDP2
    trainer): `.metadata` and `__R_K.distcp` files, and not Megatron's dist_ckpt (whose folder has metadata.json)."""
    return DIST_METADATA_FILE in names and "metadata.json" not in names and any(DCP_DATA_FILE.match(n) for n in names)
