"""Where verl's legacy Megatron checkpoint keeps its rank files: the `model/mp_rank_TT[_PPP][_EEE]` folders, which TP,
PP and expert-parallel rank each one holds, and that together they form the whole TP x PP grid.

Worked out from the folder names (no rank file is opened), so a missing, doubled or mixed-up folder is refused
before any rank file is read; `legacy.py` reads the files.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...errors import CheckpointError
from ...numbers.claims import absent
from ...storage import Location
from ..detect import MP_RANK_DIR

__all__ = ["MODEL_FILE", "RankGrid", "find_rank_folders", "rank_folders"]

MODEL_FILE = "model.pt"


def rank_folders(names: Iterable[str], has_experts: Callable[[], bool]) -> dict[str, tuple[int, int, int | None]]:
    """mp_rank folder name -> (TP rank, PP rank, expert-parallel rank or None).

    verl's legacy manager names a folder `mp_rank_TT`, appends `_PPP` when PP > 1 and then `_EEE` (the
    expert-parallel rank) when EP > 1; only data-parallel rank 0 saves, so each TP x PP rank has one folder.
    Three numbers end with the expert rank. Two are ambiguous: the second is an expert rank when the model
    has experts (`has_experts`, asked only then) and every TP rank has exactly one folder, since a PP > 1 save
    has a folder per stage for every TP rank and a PP = 1 save without EP has no suffix at all.

    >>> rank_folders(["mp_rank_00_000", "mp_rank_01_001"], lambda: True)  # TP 2, EP 2, ETP 1
    {'mp_rank_00_000': (0, 0, 0), 'mp_rank_01_001': (1, 0, 1)}
    >>> rank_folders(["mp_rank_00_000", "mp_rank_00_001"], lambda: True)  # PP 2
    {'mp_rank_00_000': (0, 0, None), 'mp_rank_00_001': (0, 1, None)}
    >>> rank_folders(["mp_rank_01_001_003"], lambda: True)  # PP 2 and EP
    {'mp_rank_01_001_003': (1, 1, 3)}
    """
    numbers = {name: tuple(int(g) for g in match.groups() if g is not None)
               for name in names if (match := MP_RANK_DIR.match(name))}
    per_tp = Counter(n[0] for n in numbers.values())
    two_are_ep = (numbers and all(len(n) == 2 for n in numbers.values()) and set(per_tp.values()) == {1}
                  and has_experts())
    folders = {}
    for name, n in numbers.items():
        if len(n) == 3 or (len(n) == 2 and two_are_ep):
            folders[name] = (n[0], n[1] if len(n) == 3 else 0, n[-1])
        else:
            folders[name] = (n[0], n[1] if len(n) > 1 else 0, None)
    return folders


@dataclass(frozen=True)
class RankGrid:
    """The rank folders of one legacy save: TP and PP sizes, the folder of each (TP rank, PP rank), and the
    expert-parallel rank each folder holds when EP > 1 (empty otherwise)."""

    tp: int
    pp: int
    folders: dict[tuple[int, int], str]
    expert_ranks: dict[tuple[int, int], int]


def find_rank_folders(model_dir: Location, has_experts: Callable[[], bool]) -> RankGrid:
    """The rank folders of `model_dir`, refused (one line naming the folder) unless there is exactly one per TP x PP
    rank, all named alike, each with its `model.pt`. `has_experts` is asked only when the names are ambiguous
    (`rank_folders`)."""
    found: dict[tuple[int, int], str] = {}
    with_pp = set()
    expert_ranks: dict[tuple[int, int], int] = {}
    folders = rank_folders(model_dir.listdir(), has_experts)
    for name, (t, p, e) in sorted(folders.items()):
        if (t, p) in found:
            raise CheckpointError(
                f"{model_dir.join(name)}: a second expert-parallel rank for TP rank {t}, PP rank {p} (besides "
                f"{found[(t, p)]}); ckptflow reads verl's legacy layout, one folder per TP x PP rank: merge a "
                "dist_ckpt save of this model instead"
            )
        numbers = len(name.split("_")) - 2
        with_pp.add(numbers == 3 or (numbers == 2 and e is None))  # the name carries a PP rank
        found[(t, p)] = name
        if e is not None:
            expert_ranks[(t, p)] = e
    if not found:
        raise CheckpointError(
            f"{model_dir}: no mp_rank_TT[_PPP] folders; point --local_dir at the actor/critic folder of a "
            "verl Megatron checkpoint"
        )
    if len(with_pp) > 1:
        raise CheckpointError(
            f"{model_dir}: mixes mp_rank_TT and mp_rank_TT_PPP folders; they come from different saves: "
            "remove the stale ones"
        )
    tp = max(t for t, _ in found) + 1
    pp = max(p for _, p in found) + 1
    missing = absent(tp * pp, [p * tp + t for t, p in found])  # the grid the highest folder names claim
    if missing.count:
        p, t = divmod(missing.lowest[0], tp)
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if True in with_pp else "") + ("_EEE" if expert_ranks else "")
        raise CheckpointError(
            f"{model_dir.join(name)}: missing (TP={tp}, PP={pp} needs every mp_rank folder); the "
            "save was incomplete: copy every mp_rank_* folder of the checkpoint"
        )
    for name in found.values():
        if not model_dir.join(name, MODEL_FILE).exists():
            raise CheckpointError(
                f"{model_dir.join(name, MODEL_FILE)}: missing; the save was incomplete: copy the whole "
                "mp_rank folder again"
            )
    return RankGrid(tp, pp, found, expert_ranks)
