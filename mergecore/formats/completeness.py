"""Which checkpoint folders under a storage root are completely written (and may be announced).

A checkpoint is a verl role folder (`.../<run>/global_step_<N>/<role>`). It is *complete* when:

- FSDP: every `model_world_size_W_rank_R.pt` for R < W (W from `fsdp_config.json`, which must agree with
  the file names), the same full set for `optim_`/`extra_state_` files when any of them exist, and
  `huggingface/config.json`;
- Megatron legacy: every `model/mp_rank_TT[_PPP]/model.pt` of the TP x PP grid the folder names show, and
  `huggingface/config.json`;
- Megatron dist_ckpt: `.metadata` (torch DCP writes it after every rank's `.distcp`) and `metadata.json` in
  `model/dist_ckpt` or `dist_ckpt`, the config beside it; in verl 0.9.1's layout `ckpt_contents.json` (written
  last) and each part it lists;
- a torch distributed checkpoint (`dcp.save`: torchtitan's `checkpoint/step-N`, Accelerate's `pytorch_model_fsdp_N`;
  not an `optimizer_N` folder beside it): `.metadata`, which DCP writes after every rank's `__R_K.distcp`;
- Megatron, when the run root holds `latest_checkpointed_iteration.txt` (verl writes it after the step):
  it names this step or a later one;
- and, for every kind, the same files with the same sizes as at the previous poll (a copy in progress
  grows files or adds them between polls). The caller keeps the previous sizes (`Poll.sizes`).

One listing (`fs.find`) per poll; only small marker files are read.

>>> first = poll("/data/ckpts")                     # doctest: +SKIP
>>> second = poll("/data/ckpts", first.sizes)       # doctest: +SKIP
>>> second.complete                                 # doctest: +SKIP
['/data/ckpts/run1/global_step_100/actor']
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import CheckpointError
from ..storage import Location
from ..numbers.claims import absent
from .detect import DCP_DATA_FILE, DIST_DIR, DIST_METADATA_FILE, MP_RANK_DIR
from .fsdp import read_fsdp_config

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CONTENTS_FILE = "ckpt_contents.json"
FSDP_CONFIG_FILE = "fsdp_config.json"
HF_CONFIG = "huggingface/config.json"
_ANY_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
_STEP_FOLDER = re.compile(r"^global_step_(\d+)$")
_OPTIMIZER_FOLDER = re.compile(r"^optimizer_\d+$")  # Accelerate's optimizer state beside pytorch_model_fsdp_N
# verl 0.9.1's ckpt_contents.json entries -> a file each one must have produced
_CONTENT_PROOF = {"model": f"model/{DIST_DIR}/{DIST_METADATA_FILE}",
                  "optimizer": f"optimizer/{DIST_DIR}/{DIST_METADATA_FILE}",
                  "hf_model": "model/huggingface/config.json"}

Sizes = dict[str, int]  # path relative to the checkpoint folder -> bytes


@dataclass
class Poll:
    """One look at a root: `complete` checkpoint URLs, what the others wait for, and every candidate's sizes
    (pass them to the next `poll`)."""

    complete: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, Sizes] = field(default_factory=dict)


def poll(root: str | Location, previous: dict[str, Sizes] | None = None) -> Poll:
    """Look at every checkpoint folder under `root` once; complete = structurally whole and unchanged since
    `previous` (the `sizes` of the last poll; None: the first look, nothing is complete yet). A folder whose
    marker files cannot be checked (damaged, hostile) waits, with the reason: one folder never stops a watch."""
    root = Location.of(root)
    files = _list_files(root)
    result = Poll()
    for folder, kind in sorted(_checkpoint_folders(files).items()):
        prefix = folder + "/" if folder else ""
        own = {p[len(prefix):]: size for p, size in files.items() if p.startswith(prefix)}
        url = root.join(folder).url if folder else root.url
        result.sizes[url] = own
        try:
            missing = _missing(kind, own, root, folder)
        except Exception as error:  # noqa: BLE001 - one folder's odd files must not stop the watch of all the others
            missing = f"cannot be checked ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]})"
        if missing is None and (previous or {}).get(url) != own:
            missing = "sizes not yet stable across two polls"
        if missing is None:
            result.complete.append(url)
        else:
            result.waiting[url] = missing
    return result


def _list_files(root: Location) -> Sizes:
    """Every file under `root` (relative posix path -> size), listed afresh."""
    fs, base = root.fs_path
    fs.invalidate_cache()  # s3fs keeps listings; a poll must see the store as it is now
    if not fs.isdir(base):
        return {}
    base = base.rstrip("/")
    found = fs.find(base, detail=True)
    return {path[len(base) + 1:]: int(info.get("size") or 0) for path, info in found.items()
            if info.get("type", "file") == "file" and path.startswith(base + "/")}


def _checkpoint_folders(files: Sizes) -> dict[str, str]:
    """{folder relative to the root: "fsdp" | "megatron_legacy" | "megatron_dist" | "dcp"}, outermost folders only
    (verl 0.9.1's `model/dist_ckpt` would otherwise also make `model/` look like an old-layout folder)."""
    found: dict[str, str] = {}
    for path in files:
        parts = path.split("/")
        name, parent = parts[-1], "/".join(parts[:-1])
        if _ANY_RANK_FILE.match(name) or name == FSDP_CONFIG_FILE:
            found.setdefault(parent, "fsdp")
        for i, part in enumerate(parts[:-1]):
            above = "/".join(parts[:i])
            if part == "model" and i + 1 < len(parts) - 1 and MP_RANK_DIR.match(parts[i + 1]):
                found.setdefault(above, "megatron_legacy")
            elif part == DIST_DIR:
                outer = "/".join(parts[:i - 1]) if i > 0 and parts[i - 1] == "model" else above
                found.setdefault(outer, "megatron_dist")
        if name == CONTENTS_FILE:
            found[parent] = "megatron_dist"
        if DCP_DATA_FILE.match(name) and DIST_DIR not in parts and not _OPTIMIZER_FOLDER.match(parts[-2] if
                                                                                               len(parts) > 1 else ""):
            found.setdefault(parent, "dcp")
    return {f: kind for f, kind in found.items()
            if not any(f.startswith(other + "/") or (other == "" and f) for other in found if other != f)}


def _missing(kind: str, files: Sizes, root: Location, folder: str) -> str | None:
    """Why the checkpoint folder is not complete yet, or None."""
    checks = {"fsdp": _fsdp_missing, "megatron_legacy": _legacy_missing, "megatron_dist": _dist_missing,
              "dcp": _dcp_missing}
    reason = checks[kind](files, root.join(folder) if folder else root)
    if reason is None and kind not in ("fsdp", "dcp"):
        reason = _tracker_missing(root, folder)
    return reason


def _fsdp_missing(files: Sizes, folder: Location) -> str | None:
    if FSDP_CONFIG_FILE not in files:
        return f"no {FSDP_CONFIG_FILE}"
    if HF_CONFIG not in files:
        return f"no {HF_CONFIG}"
    try:
        world_size = read_fsdp_config(folder.join(FSDP_CONFIG_FILE)).get("world_size")
    except (OSError, CheckpointError) as error:  # written as we look, or bad: the reader says which, in one line
        return f"{FSDP_CONFIG_FILE} unreadable yet ({error})"
    if world_size is None:
        return f"{FSDP_CONFIG_FILE} names no world_size"
    by_kind: dict[str, set[tuple[int, int]]] = {}
    for name in files:
        match = _ANY_RANK_FILE.match(name)
        if match:
            by_kind.setdefault(match[1], set()).add((int(match[2]), int(match[3])))
    if "model" not in by_kind:
        return "no model rank files"
    for prefix, present in sorted(by_kind.items()):
        # the world size is a claim: compared with the files listed, never enumerated (`claims.absent`)
        missing = absent(world_size, [r for w, r in present if w == world_size], show=8)
        if missing.count:
            return f"{prefix} rank files for world size {world_size} incomplete (missing ranks {missing.lowest})"
        if any(w != world_size or r >= world_size for w, r in present):
            return f"{prefix} rank files name a world size other than {world_size}"
    return None


def _legacy_missing(files: Sizes, folder: Location) -> str | None:
    grid = set()
    for path in files:
        parts = path.split("/")
        if len(parts) >= 2 and parts[0] == "model" and MP_RANK_DIR.match(parts[1]):
            match = MP_RANK_DIR.match(parts[1])
            grid.add((int(match[1]), int(match[2] or 0), parts[1]))
    tp = max(t for t, _, _ in grid) + 1
    pp = max(p for _, p, _ in grid) + 1
    named = {(t, p): name for t, p, name in grid}
    missing = absent(tp * pp, [t * pp + p for t, p in named])  # the grid the highest folder names claim
    if missing.count:
        t, p = divmod(missing.lowest[0], pp)
        return f"model/mp_rank folder for tp {t}, pp {p} missing"
    for t, p in sorted(named):
        if f"model/{named[t, p]}/model.pt" not in files:
            return f"model/{named[t, p]}/model.pt missing"
    return None if HF_CONFIG in files else f"no {HF_CONFIG}"


def _dist_missing(files: Sizes, folder: Location) -> str | None:
    if CONTENTS_FILE in files or f"model/{DIST_DIR}/{DIST_METADATA_FILE}" in files or any(
            p.startswith(f"model/{DIST_DIR}/") for p in files):
        if CONTENTS_FILE not in files:
            return f"no {CONTENTS_FILE} (verl writes it last)"
        try:
            parts = json.loads(folder.join(CONTENTS_FILE).read_text())
        except (OSError, ValueError, RecursionError) as error:
            return f"{CONTENTS_FILE} unreadable yet ({type(error).__name__})"
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            return f"{CONTENTS_FILE} is not a list of part names (verl writes [\"model\", ...])"
        needed = [_CONTENT_PROOF[p] for p in parts if p in _CONTENT_PROOF]
        needed += [f"model/{DIST_DIR}/{DIST_METADATA_FILE}", f"model/{DIST_DIR}/metadata.json"]
        if "hf_model" not in parts:
            needed.append("model/huggingface/config.json")
    else:  # older verl: dist_ckpt/ and huggingface/ at the role folder
        needed = [f"{DIST_DIR}/{DIST_METADATA_FILE}", f"{DIST_DIR}/metadata.json", HF_CONFIG]
    absent = [p for p in dict.fromkeys(needed) if p not in files]
    return f"{absent[0]} missing" if absent else None


def _dcp_missing(files: Sizes, folder: Location) -> str | None:
    return None if DIST_METADATA_FILE in files else f"no {DIST_METADATA_FILE} (DCP writes it after every rank's data)"


def _tracker_missing(root: Location, folder: str) -> str | None:
    """verl writes the run root's tracker after the step's files: where it exists it must have reached this step."""
    parts = folder.split("/") if folder else []
    steps = [i for i, p in enumerate(parts) if _STEP_FOLDER.match(p)]
    if not steps:
        return None
    step_index = steps[-1]
    step = int(_STEP_FOLDER.match(parts[step_index])[1])
    tracker = root.join(*parts[:step_index], TRACKER_FILE) if step_index else root.join(TRACKER_FILE)
    try:
        written = int(tracker.read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return f"{TRACKER_FILE} unreadable yet"
    return None if written >= step else f"{TRACKER_FILE} names step {written}, not yet {step}"
