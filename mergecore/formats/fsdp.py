"""verl FSDP checkpoints: one `model_world_size_W_rank_R.pt` per rank.

Every FSDP wrapping verl uses (FSDP2, HSDP, FSDP1 with and without a mesh, single process) is behind this one reader;
each has a section of its own.

Values per rank, by how training was wrapped (see docs/facts.md):
FSDP2 / FSDP1-with-mesh -> DTensor (Shard(d) on a 1-D mesh, or (Replicate(), Shard(0)) for HSDP);
FSDP1 without a mesh -> ShardedTensor; a single GPU -> plain tensors.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..numbers.arrays import bitwise_equal
from ..errors import CheckpointError
from ..storage import Location, RangeFile, fetch_ranges
from .base import CheckpointSource, Piece, TensorInfo
from ..numbers.claims import absent
from .detect import FSDP_RANK_FILE as RANK_FILE
from .fetching import FetchesByGroup
from .torchfile import DTensorRecord, ShardedTensorRecord, fetch_archive_metadata, load, member_span


REMOTE_OPENS = 16  # remote rank files whose archive directories are read at once


def load_rank_file(path: str, shown_as: str) -> dict:
    """A rank's state dict, read without torch: DTensors and ShardedTensors become records whose
    tensors are numpy views of the mmapped file, so nothing is read until it is used."""
    state = load(path, shown_as)
    if not isinstance(state, dict):
        raise CheckpointError(f"{shown_as}: holds a {type(state).__name__}, not a state dict; is this a model_*.pt file?")
    return state


def chunk_span(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk `index` when `length` is split like torch.chunk; tails may be empty."""
    if length % parts == 0:
        size = length // parts
        return size * index, size
    full = -(-length // parts)
    start = min(full * index, length)
    return start, max(0, min(length, start + full) - start)


def dtensor_region(shape, mesh_shape, coordinate, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where the rank at `coordinate` sits in the global tensor (DTensor's left-to-right rule)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            d = placement.dim
            offset, size = chunk_span(sizes[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offsets[d] += offset
            sizes[d] = size
        elif not placement.is_replicate():
            raise CheckpointError(f"placement {placement} is not supported (only Shard and Replicate)")
    return tuple(offsets), tuple(sizes)


def _placement_text(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _global_view(value) -> tuple[tuple[int, ...], str]:
    """(global shape, dtype name) of a rank file entry."""
    from ..numbers.arrays import dtype_of

    if isinstance(value, (DTensorRecord, ShardedTensorRecord)):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, np.ndarray):
        return tuple(value.shape), dtype_of(value)
    return (), type(value).__name__


def _layout_text(value, coordinates: _MeshCoordinates, name: str) -> str:
    if isinstance(value, DTensorRecord):
        return f"DTensor{_placement_text(value.placements)} mesh {coordinates.shape(value.device_mesh, name)}"
    return "ShardedTensor(dim 0)" if isinstance(value, ShardedTensorRecord) else "plain"


class _Saved(NamedTuple):
    """One rank's entry, summarised. `layout`, `mesh_ranks` and `pieces` hold the CheckpointError their
    reading raised instead, so it is raised by the check that asks, in the order the checks run."""

    shape: tuple[int, ...]
    dtype: str
    layout: str | CheckpointError
    mesh_ranks: int | CheckpointError | None
    pieces: list[Piece] | CheckpointError
    is_dtensor: bool


def _deferred(compute, *args):
    try:
        return compute(*args)
    except CheckpointError as err:
        return err


def _raised(value):
    if isinstance(value, CheckpointError):
        raise value
    return value


def read_fsdp_config(where: Location) -> dict:
    """verl's `fsdp_config.json`: `{"FSDP_version": 1|2, "world_size": W}`, W a positive integer (a claim:
    readers compare it with the rank files present, `claims.absent`)."""
    from ..storage.tensorio import read_json

    fix = 'fix it (verl writes {"FSDP_version": 2, "world_size": W}) or delete it to infer W from the rank files'
    config = read_json(where, fix=fix)
    world = config.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise CheckpointError(f"{where}: world_size is {world!r}, not a positive integer; {fix}")
    return config


class FsdpCheckpoint(FetchesByGroup, CheckpointSource):
    format_name = "verl-fsdp"

    def __init__(self, location: Location, hf_dir: Location | None = None, step: int | None = None):
        self.location = location
        self.hf_dir = hf_dir if hf_dir is not None else location.join("huggingface")
        self.step = step
        names = location.listdir()
        self._fsdp_config = read_fsdp_config(location.join("fsdp_config.json")) if "fsdp_config.json" in names else {}
        self.world_size, self._rank_names = self._find_ranks(names)

    def _find_ranks(self, names: list[str]) -> tuple[int, list[str]]:
        found = {}
        sizes = set()
        for name in names:
            match = RANK_FILE.match(name)
            if match:
                sizes.add(int(match[1]))
                found[(int(match[1]), int(match[2]))] = name
        if not found:
            raise CheckpointError(
                f"{self.location}: no model_world_size_W_rank_R.pt files; point --local_dir at the actor/critic "
                "folder, a global_step_N folder or the run root"
            )
        declared = self._fsdp_config.get("world_size")
        if declared is None and len(sizes) > 1:
            raise CheckpointError(
                f"{self.location}: rank files of several world sizes {sorted(sizes)}; remove the stale ones"
            )
        world = int(declared) if declared is not None else sizes.pop()
        if world not in {w for w, _ in found}:
            raise CheckpointError(
                f"{self.location.join('fsdp_config.json')}: says world_size {world} but the rank files are for "
                f"world size {sorted({w for w, _ in found})}; fix fsdp_config.json or the file names"
            )
        # the world size is a claim (fsdp_config.json, a file name): compared with the rank files listed, never
        # enumerated, so 10**18 beside one rank file costs what that one file costs
        missing = absent(world, [r for w, r in found if w == world])
        if missing.count:
            raise CheckpointError(
                f"{self.location.join(f'model_world_size_{world}_rank_{missing.lowest[0]}.pt')}: missing "
                f"({missing.count} of {world} rank files absent); the save was incomplete: copy every rank file"
            )
        return world, [found[(world, r)] for r in range(world)]

    # ---- reading -------------------------------------------------------------------------------

    def rank_location(self, rank: int) -> Location:
        return self.location.join(self._rank_names[rank])

    @cached_property
    def _saved(self) -> list[dict[str, _Saved]]:
        """Per rank, what the checks and the merge need of each entry. A rank file's records are
        dropped once summarised: thousands of ranks would otherwise keep millions of small objects
        alive for Python's cycle collector to rescan; the pieces' arrays stay views of the mapped file."""
        with _collector_paused():
            if self.location.is_local:
                return [self._summarise(rank, self._load_rank(rank)) for rank in range(self.world_size)]
            from concurrent.futures import ThreadPoolExecutor

            self._range_files  # made before the threads fill it
            with ThreadPoolExecutor(REMOTE_OPENS) as pool:  # a few round trips per remote file: overlap them
                return [self._summarise(rank, state) for rank, state in enumerate(pool.map(self._load_rank, range(self.world_size)))]

    def _summarise(self, rank: int, state: dict) -> dict[str, _Saved]:
        shown = str(self.rank_location(rank))
        coordinates = _MeshCoordinates(rank, shown)
        if rank == 0:
            first = next(iter(state.values()), None)
            self._first_mesh = first.device_mesh if isinstance(first, DTensorRecord) else None
        summary = {}
        for name, value in state.items():
            shape, dtype = _global_view(value)
            dtensor = isinstance(value, DTensorRecord)
            summary[name] = _Saved(shape, dtype, _deferred(_layout_text, value, coordinates, name),
                                   _deferred(coordinates.size, value.device_mesh, name) if dtensor else None,
                                   _deferred(self._pieces_of, name, value, coordinates, shown), dtensor)
        return summary

    def _load_rank(self, rank: int) -> dict:
        """A local rank file is mapped in place; a remote one is read by range (`RangeFile`): its archive
        directory and pickle now, each tensor's bytes when its pieces are asked for (`_fetched`)."""
        location, shown = self.rank_location(rank), str(self.rank_location(rank))
        if location.is_local:
            return load_rank_file(location.local_file(), shown)
        remote = RangeFile.of(location)
        fetch_archive_metadata(remote.fetch, remote.path, remote.size, shown)
        self._range_files[shown] = remote
        return load_rank_file(remote.path, shown)

    @cached_property
    def _range_files(self) -> dict[str, RangeFile]:
        return {}

    def _fetched(self, pieces: list[Piece], name: str) -> list[Piece]:
        """`pieces`, their bytes downloaded first when they come from remote rank files and CRC-checked
        (see FetchesByGroup)."""
        self._ready_for(name)
        return pieces

    def _reads_remotely(self) -> bool:
        return bool(self._range_files)

    def _fetchable_names(self):
        return self._saved_pieces

    def _download(self, names: list[str]) -> None:
        spans: dict[RangeFile, list[tuple[int, int]]] = {}
        for member in names:
            for piece in self._saved_pieces[member]:
                span = member_span(piece.tensor)
                if span and piece.source in self._range_files:
                    spans.setdefault(self._range_files[piece.source], []).append(span)
        fetch_ranges(spans)

    def _saved_arrays(self, names: list[str]):
        return [piece.tensor for name in names for piece in self._saved_pieces[name]]

    @cached_property
    def _saved_pieces(self) -> dict[str, list[Piece]]:
        """Every saved tensor's pieces, from metadata alone (values stay mmapped)."""
        table: dict[str, list[Piece]] = {}
        for summary in self._saved:
            for name, saved in summary.items():
                table.setdefault(name, []).extend(_raised(saved.pieces))
        return table

    def _pieces_of(self, name: str, value, coordinates: _MeshCoordinates, shown: str) -> list[Piece]:
        if isinstance(value, DTensorRecord):
            mesh_shape, coordinate = coordinates.of(value.device_mesh, name)
            offsets, sizes = dtensor_region(value.shape, mesh_shape, coordinate, value.placements)
            local = value.local
            if tuple(local.shape) != sizes:
                raise CheckpointError(
                    f"{shown}: tensor {name} holds a shard of shape {tuple(local.shape)} but {_placement_text(value.placements)} "
                    f"on mesh {mesh_shape} gives {sizes}; the file does not belong to this world size"
                )
            primary = all(c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate())
            return [Piece(shown, offsets, sizes, local, primary)]
        if isinstance(value, ShardedTensorRecord):
            return [
                Piece(shown, tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor)
                for s in value.local_shards
            ]
        if isinstance(value, np.ndarray):
            return [Piece(shown, (0,) * value.ndim, tuple(value.shape), value, primary=coordinates.rank == 0)]
        raise CheckpointError(f"{shown}: entry {name} is a {type(value).__name__}, not a tensor")

    @cached_property
    def _saved_infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(name, saved.shape, saved.dtype, _raised(saved.layout))
                for name, saved in self._saved[0].items()}

    def tensors(self) -> dict[str, TensorInfo]:
        """The saved names (transformers' in-memory layout; PEFT names for LoRA): `mergecore.engine.merge.merge_view`
        gives the names a merge writes."""
        return self._saved_infos

    def pieces(self, name: str) -> Iterator[Piece]:
        return iter(self._fetched(self._saved_pieces[name], name))

    def input_files(self, names=None) -> list[Location]:
        return [self.rank_location(r) for r in range(self.world_size)]  # every rank holds a slice of every tensor

    # ---- checks --------------------------------------------------------------------------------

    def validate(self, check_replicas: bool = False) -> None:
        self._check_same_keys()
        for name, info in self._saved_infos.items():
            self._check_same_global_view(name, info)
            self._check_tiling(name, info)
            if check_replicas:
                self._check_replicas(name)
            elif self._saved_whole_by_every_rank(name):
                self._check_whole_copies(name)

    def _check_same_keys(self) -> None:
        expected = set(self._saved[0])
        for rank, summary in enumerate(self._saved[1:], start=1):
            if set(summary) != expected:
                odd = sorted(set(summary) ^ expected)[0]
                where = "missing from" if odd in expected else "only in"
                raise CheckpointError(
                    f"{self.rank_location(rank)}: tensor {odd} is {where} this rank (rank 0 differs); "
                    "rank files come from different saves: re-copy the checkpoint"
                )

    def _check_same_global_view(self, name: str, info: TensorInfo) -> None:
        for rank, summary in enumerate(self._saved):
            saved = summary[name]
            if saved.shape != info.shape or saved.dtype != info.dtype:
                raise CheckpointError(
                    f"{self.rank_location(rank)}: tensor {name} is {tuple(saved.shape)} {saved.dtype} here but {info.shape} "
                    f"{info.dtype} on rank 0; rank files come from different saves: re-copy the checkpoint"
                )
            if saved.is_dtensor:
                layout = _raised(saved.layout)
                if layout != info.layout:
                    raise CheckpointError(
                        f"{self.rank_location(rank)}: tensor {name} is {layout} here but {info.layout} on rank 0"
                    )
                mesh_ranks = _raised(saved.mesh_ranks)
                if mesh_ranks != self.world_size:
                    raise CheckpointError(
                        f"{self.rank_location(rank)}: device mesh of {mesh_ranks} ranks in a "
                        f"checkpoint of world size {self.world_size}; fix fsdp_config.json or the file names"
                    )

    def _check_tiling(self, name: str, info: TensorInfo) -> None:
        """The primary pieces must cover the global tensor exactly once."""
        primary = [p for p in self._saved_pieces[name] if p.primary]
        for piece in primary:
            if tuple(piece.tensor.shape) != piece.sizes:
                raise CheckpointError(f"{piece.source}: tensor {name} shard shape {tuple(piece.tensor.shape)} != {piece.sizes}")
            if len(piece.offsets) != len(info.shape):
                raise CheckpointError(f"{piece.source}: tensor {name} shard at {piece.offsets} does not match {info.shape}")
        offsets, sizes = _boxes(primary, len(info.shape))
        outside = np.flatnonzero(((offsets + sizes) > np.asarray(info.shape, dtype=np.int64)).any(axis=1)
                                 | (offsets < 0).any(axis=1))
        if len(outside):
            piece = primary[outside[0]]
            raise CheckpointError(f"{piece.source}: tensor {name} shard at {piece.offsets} exceeds {info.shape}")
        covered = int(np.prod(sizes, axis=1).sum())
        overlap = _any_overlap(offsets, sizes)
        if covered != info.numel or overlap:
            raise CheckpointError(
                f"{self.location}: the shards of tensor {name} do not tile its global shape {info.shape} "
                f"({covered} of {info.numel} elements{', overlapping' if overlap else ''}); a rank file is from another save"
            )

    def _saved_whole_by_every_rank(self, name: str) -> bool:
        """A plain tensor in a multi-rank FSDP file: a persistent buffer, which FSDP does not shard (every rank
        saves a whole copy; small, so its copies are always compared)."""
        return self.world_size > 1 and _raised(self._saved[0][name].layout) == "plain"

    def _check_whole_copies(self, name: str) -> None:
        first = next(p for p in self._saved_pieces[name] if p.primary)
        for piece in self._fetched(self._saved_pieces[name], name):
            if not piece.primary and not bitwise_equal(piece.tensor, first.tensor):
                raise CheckpointError(
                    f"{piece.source}: tensor {name}, which every rank saves whole (a buffer), differs from the copy in "
                    f"{first.source}; the ranks' copies diverged during training and no merge can tell which is right: "
                    "keep the rank file whose copy you trust and copy that tensor into the others, or re-save"
                )

    def _check_replicas(self, name: str) -> None:
        primary = {p.offsets: p for p in self._saved_pieces[name] if p.primary}
        for piece in self._fetched(self._saved_pieces[name], name):
            if not piece.primary and not bitwise_equal(piece.tensor, primary[piece.offsets].tensor):
                raise CheckpointError(
                    f"{piece.source}: tensor {name} differs from the same shard on another data-parallel replica; "
                    "the replicas diverged during training: pick the replica to trust and re-save"
                )

    def describe(self) -> dict:
        mesh_shape, mesh_names = [self.world_size], None
        self._saved  # noqa: B018 (reads rank 0's mesh)
        if self._first_mesh is not None:
            mesh_shape = list(self._first_mesh.mesh.shape)
            mesh_names = list(self._first_mesh.mesh_dim_names or [])
        return {
            "format": self.format_name,
            "location": str(self.location),
            "step": self.step,
            "role": self.location.name,
            "world_size": self.world_size,
            "fsdp_version": self._fsdp_config.get("FSDP_version"),
            "mesh_shape": mesh_shape,
            "mesh_dim_names": mesh_names,
            "files": [self._rank_names[r] for r in range(self.world_size)],
        }


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector off while thousands of rank files become records: it would rescan
    every record already made, again and again (2.2x the load time at W=1024). Records hold no
    cycles, so nothing is left for it to find. They are then frozen (`gc.freeze`) before it is back
    on: otherwise its next runs walk them through every generation (three scans of ~300k objects at
    W=1024, 0.5 s). Frozen objects are still freed when their last reference goes; only a cycle
    frozen with them would outlive its use, and records make none."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


class _MeshCoordinates:
    """Where one rank sits on each device mesh of its file. A rank file's DTensors share one pickled
    mesh, so the grid is searched once per mesh, not once per tensor."""

    def __init__(self, rank: int, shown: str):
        self.rank, self.shown = rank, shown
        self._found: dict[int, tuple[object, tuple[int, ...], tuple[int, ...]]] = {}

    def of(self, mesh_record, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(mesh shape, this rank's coordinate) on `mesh_record`; `name` only words the error."""
        known = self._found.get(id(mesh_record))
        if known is None or known[0] is not mesh_record:
            known = (mesh_record, *self._locate(mesh_record, name))
            self._found[id(mesh_record)] = known
        return known[1], known[2]

    def shape(self, mesh_record, name: str) -> tuple[int, ...]:
        return tuple(self._grid(mesh_record, name).shape)

    def size(self, mesh_record, name: str) -> int:
        return int(self._grid(mesh_record, name).size)

    def _grid(self, mesh_record, name: str) -> np.ndarray:
        try:
            return np.asarray(mesh_record.mesh)
        except (AttributeError, TypeError, ValueError, IndexError, MemoryError) as err:
            reason = f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
            raise CheckpointError(
                f"{self.shown}: tensor {name} has a device mesh that cannot be read ({reason[:200]}); "
                "the file is damaged or not a verl FSDP rank file: copy it again"
            ) from None

    def _locate(self, mesh_record, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        mesh = self._grid(mesh_record, name)
        where = np.argwhere(mesh == self.rank)
        if len(where) != 1:
            raise CheckpointError(f"{self.shown}: tensor {name} has a device mesh {mesh.tolist()} without rank {self.rank}")
        saved_by = getattr(mesh_record, "_rank", None)  # torch >= 2.4 pickles the saving rank with the mesh
        if type(saved_by) is int and saved_by != self.rank:
            raise CheckpointError(
                f"{self.shown}: was saved by rank {saved_by}, not rank {self.rank} as its name says; "
                "a rank file was copied or renamed: copy every rank file again from where training saved them"
            )
        return tuple(mesh.shape), tuple(where[0].tolist())


def _boxes(pieces: list[Piece], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces' offsets and sizes as (n, ndim) int64 arrays."""
    try:
        offsets = np.array([p.offsets for p in pieces], dtype=np.int64).reshape(len(pieces), ndim)
        sizes = np.array([p.sizes for p in pieces], dtype=np.int64).reshape(len(pieces), ndim)
    except OverflowError:
        raise CheckpointError(f"{pieces[0].source}: a shard offset does not fit in 64 bits; the file is damaged") from None
    return offsets, sizes


def _any_overlap(offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether two non-empty boxes share an element, by sorting their starts along the dimension where
    they start at the most places. The layouts FSDP writes (shards along one dimension) are decided
    there in O(n log n); other layouts go on to a sweep that compares each box only with the boxes
    still open at its start, never all n^2 pairs."""
    keep = (sizes > 0).all(axis=1)
    offsets, sizes = offsets[keep], sizes[keep]
    if len(offsets) < 2:
        return False
    if offsets.shape[1] == 0:  # scalars: two pieces of one scalar always overlap
        return True
    axis = max(range(offsets.shape[1]), key=lambda d: len(np.unique(offsets[:, d])))
    order = np.argsort(offsets[:, axis], kind="stable")
    offsets, sizes = offsets[order], sizes[order]
    starts, ends = offsets[:, axis], offsets[:, axis] + sizes[:, axis]
    if (starts[1:] >= np.maximum.accumulate(ends)[:-1]).all():
        return False  # apart along this axis already
    return _sweep_finds_overlap(offsets.tolist(), sizes.tolist(), axis)


def _sweep_finds_overlap(offsets: list, sizes: list, axis: int) -> bool:
    """Boxes sorted by their start along `axis`: each is compared with the boxes still open there."""
    open_boxes: list[int] = []
    for i, (box_offsets, box_sizes) in enumerate(zip(offsets, sizes)):
        start = box_offsets[axis]
        open_boxes = [j for j in open_boxes if offsets[j][axis] + sizes[j][axis] > start]
        if any(_overlaps(box_offsets, box_sizes, offsets[j], sizes[j]) for j in open_boxes):
            return True
        open_boxes.append(i)
    return False


def _overlaps(a_offsets, a_sizes, b_offsets, b_sizes) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes))
