"""verl's legacy Megatron checkpoints: `<role>/model/mp_rank_TT[_PPP]/model.pt`, read without megatron-core.

The legacy layout's per-rank pieces and their TP/PP/VPP/EP placement are one reader: its rank folders are found by
`mp_ranks.py`, the Megatron name tables and transforms are data in `families/`, what both readers share is in
`common.py`.

Each `model.pt` holds one TP x PP rank's model state, as a list of per-virtual-pipeline-chunk state
dicts (verl). Also read: a dict with `"model"` (a state dict or a list) or `"model0"`, `"model1"`...
(Megatron-LM's own files). Layer indices restart at 0 in every chunk; chunk `v` of pipeline rank `p`
comes at position `v * PP + p` in the model, so layer offsets are the layer counts of the chunks
before it in that order (uneven stages included). Chunks already numbered globally are accepted too.
With expert parallelism verl appends the expert-parallel rank (`mp_rank_TT[_PPP]_EEE`); each file numbers
its experts from 0, so they are renumbered globally (`mp_ranks.rank_folders`, `_expert_placements`).

Names are mapped by the tables of `mergecore.families.megatron_maps`; values are merged by the transforms of
`mergecore.families.transforms`, one Hugging Face tensor at a time (a layer's q_proj reads that layer's QKV
piece of each TP rank, nothing else). `check_round_trip` applies the inverse transform to the
merged output and compares it with every saved piece, bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...errors import CheckpointError
from ...families.layout import dimensions
from ...families.megatron_maps import SKIPPED, Mapped, resolve
from ...storage import Location, RangeFile, fetch_ranges
from ...numbers.arrays import bitwise_equal, dtype_of
from ...families.transforms import Transform
from ..base import CheckpointSource, Piece, TensorInfo
from ..detect import MP_RANK_DIR
from ..fetching import FetchesByGroup
from .. import torchfile
from ..torchfile import fetch_archive_metadata, member_span
from ...numbers.claims import absent
from .checks import check_layers, check_moe
from .common import MegatronReader
from .mp_ranks import MODEL_FILE, find_rank_folders
from ..untrusted import Record, megatron_file


# ---- loading -----------------------------------------------------------------------------------

def load_model_file(path: str, shown_as: str):
    """A `model.pt` (or dist_ckpt `common.pt`) through the Megatron allow-list (`untrusted.megatron_file`):
    tensors are read-only numpy views of the mapped file, bounded by their own zip member;
    the `args` Namespace, enums and TransformerEngine extra state are inert records. torch.load is
    not used: it reads a storage past its member and lets a pickle allocate (`torch.Tensor(n)`),
    and importing torch alone costs a merge ~2 s."""
    return torchfile.load(path, shown_as, allowed=megatron_file())


def model_chunks(obj, shown_as: str) -> list[dict[str, np.ndarray]]:
    """The per-virtual-stage state dicts of a loaded `model.pt`, weights only (extra state dropped)."""
    if isinstance(obj, (list, tuple)):
        chunks = list(obj)
    elif isinstance(obj, dict) and "model" in obj:
        chunks = list(obj["model"]) if isinstance(obj["model"], (list, tuple)) else [obj["model"]]
    elif isinstance(obj, dict) and "model0" in obj:
        chunks, v = [], 0
        while f"model{v}" in obj:
            chunks.append(obj[f"model{v}"])
            v += 1
    elif isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj) and any(
            isinstance(v, np.ndarray) for v in obj.values()):
        chunks = [obj]
    else:
        found = ", ".join(map(str, list(obj)[:5])) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"{shown_as}: holds no model state (expected a list of state dicts, or a dict with 'model' or "
            f"'model0'; found {found}); point --local_dir at the role folder of a verl Megatron checkpoint"
        )
    if not chunks:
        raise CheckpointError(f"{shown_as}: holds an empty list of model chunks; the save was incomplete")
    cleaned = []
    for v, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            raise CheckpointError(f"{shown_as}: model chunk {v} is a {type(chunk).__name__}, not a state dict")
        state = {}
        for key, value in chunk.items():
            name = str(key)
            while name.startswith("module."):
                name = name[len("module."):]
            if SKIPPED.search(name) or value is None:
                continue
            if not isinstance(value, np.ndarray):
                raise CheckpointError(f"{shown_as}: entry {name} of model chunk {v} is a {type(value).__name__}, not a tensor")
            state[name] = value
        cleaned.append(state)
    return cleaned


def _arrays(obj) -> Iterator[np.ndarray]:
    """Every array inside a loaded file's object tree (dicts, lists, tuples, records' fields)."""
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, np.ndarray):
            yield item
        elif id(item) not in seen and isinstance(item, (dict, list, tuple, set, Record)):
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else vars(item).values() if isinstance(item, Record)
                         else item)


# ---- expert parallelism (EP > 1) ---------------------------------------------------------------

def is_expert_row(mapped: Mapped) -> bool:
    """A routed expert's weight (`...mlp.experts.local_experts.{E}...`): numbered per expert-parallel rank."""
    return mapped.is_layer and ".mlp.experts." in mapped.pattern and len(mapped.indices) == 2


# ---- the index: HF name -> where its pieces are ------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor: which Megatron key of which pipeline chunk holds it, and how."""

    name: str
    pp: int
    vpp: int
    key: str
    part: str
    transform: Transform
    mapped: Mapped
    ranks: tuple[int, ...] = ()  # the TP ranks holding it (one expert-parallel rank's experts); () = all


class MegatronLegacyCheckpoint(MegatronReader, FetchesByGroup, CheckpointSource):
    format_name = "verl-megatron-legacy"

    def __init__(self, location: Location, hf_dir: Location | None = None, step: int | None = None,
                 custom_mapping: str | None = None):
        self.location = location
        self.model_dir = location.join("model")
        if hf_dir is None:
            hf_dir = location.join("huggingface")
            nested = self.model_dir.join("huggingface")
            if not hf_dir.join("config.json").exists() and nested.join("config.json").exists():
                hf_dir = nested
        self.hf_dir = hf_dir
        self.step = step
        self.custom_mapping = Location.of(custom_mapping).url if custom_mapping else None  # absolute: kept in manifests
        grid = find_rank_folders(self.model_dir, lambda: bool(dimensions(self.config).get("num_experts")))
        self.tp, self.pp, self._rank_dirs = grid.tp, grid.pp, grid.folders
        self._expert_rank = grid.expert_ranks  # (tp, pp) -> expert-parallel rank, when EP > 1
        self._states: dict[tuple[int, int], list[dict]] = {}
        self._lock = threading.Lock()

    # ---- the rank files ------------------------------------------------------------------------

    def file(self, tp_rank: int, pp_rank: int) -> Location:
        return self.model_dir.join(self._rank_dirs[(tp_rank, pp_rank)], MODEL_FILE)

    def _shown(self, tp_rank: int, pp_rank: int) -> str:
        return str(self.file(tp_rank, pp_rank))

    def chunks(self, tp_rank: int, pp_rank: int) -> list[dict[str, np.ndarray]]:
        """The state dicts (one per virtual stage) of one rank's file; tensors stay mmapped."""
        key = (tp_rank, pp_rank)
        if key not in self._states:
            with self._lock:
                if key not in self._states:
                    location = self.file(tp_rank, pp_rank)
                    self._states[key] = self._load(location)
        return self._states[key]

    def _load(self, location: Location) -> list[dict[str, np.ndarray]]:
        """A local file is mapped in place. A remote one is read by range (`RangeFile`): its archive directory
        and pickle now, not one byte of any tensor (the archive may hold the optimizer state too), and each
        tensor's bytes when its group is asked for (`_fetch`); ranges are never joined across a tensor
        outside the model chunks."""
        shown = str(location)
        if location.is_local:
            return model_chunks(load_model_file(location.local_file(), shown), shown)
        remote = RangeFile.of(location)
        fetch_archive_metadata(remote.fetch, remote.path, remote.size, shown, header_slack=0)
        loaded = load_model_file(remote.path, shown)
        chunks = model_chunks(loaded, shown)
        model = {span for chunk in chunks for value in chunk.values() if (span := member_span(value))}
        remote.keep_out(span for span in map(member_span, _arrays(loaded)) if span and span not in model)
        self._range_files[shown] = remote
        return chunks

    @cached_property
    def _range_files(self) -> dict[str, RangeFile]:
        return {}

    def _fetch(self, entries: Iterable[Entry]) -> None:
        """Download the bytes of `entries`' pieces on every TP rank from remote files, in one concurrent batch."""
        if not self._range_files:
            return
        spans: dict[RangeFile, list[tuple[int, int]]] = {}
        for entry in entries:
            for t in self._ranks(entry):
                span = member_span(self._piece(t, entry))
                if span:
                    spans.setdefault(self._range_files[self._shown(t, entry.pp)], []).append(span)
        fetch_ranges(spans)

    def _reads_remotely(self) -> bool:
        return bool(self._range_files)

    def _fetchable_names(self):
        return self._entries

    def _download(self, names: list[str]) -> None:
        self._fetch(self._entries[name] for name in names)

    def _saved_arrays(self, names: list[str]):
        return [self._piece(t, self._entries[name]) for name in names for t in self._ranks(self._entries[name])]

    @cached_property
    def vpp(self) -> int:
        sizes = {(t, p): len(self.chunks(t, p)) for p in range(self.pp) for t in range(self.tp)}
        first = sizes[(0, 0)]
        for (t, p), size in sizes.items():
            if size != first:
                raise CheckpointError(
                    f"{self._shown(t, p)}: holds {size} virtual pipeline chunks but {self._shown(0, 0)} holds {first}; "
                    "the rank files come from different saves: re-copy the checkpoint"
                )
        return first

    def chunk_order(self) -> list[tuple[int, int]]:
        """(pp rank, virtual stage) of every model chunk, in model order."""
        return [(p, v) for v in range(self.vpp) for p in range(self.pp)]

    def saved_parameters(self) -> dict[str, str]:
        return {key: key for p, v in self.chunk_order() for key in self.chunks(0, p)[v]}

    def _output_rows(self) -> int | None:
        output = self.chunks(0, self.pp - 1)[-1].get("output_layer.weight")
        return None if output is None else output.shape[0]

    @cached_property
    def _layer_spans(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(first saved layer index, layer count) of every chunk."""
        spans = {}
        for p, v in self.chunk_order():
            shown = f"{self._shown(0, p)} (chunk {v})"
            mapped = [resolve(k, self._table, shown) for k in self.chunks(0, p)[v]]
            local = {m.indices[0] for m in mapped if m.is_layer}
            first = min(local, default=0)
            # layer numbers are claims of the key names: a gap is looked for among the layers present only
            missing = absent(len(local), [layer - first for layer in local])
            if missing.count:
                gap = first + missing.lowest[0]
                raise CheckpointError(
                    f"{shown}: has decoder layers {sorted(local)} but no layer {gap}; the file is damaged or from "
                    "another save"
                )
            spans[(p, v)] = (first, len(local))
        return spans

    @cached_property
    def layers_per_chunk(self) -> dict[tuple[int, int], int]:
        return {chunk: count for chunk, (_, count) in self._layer_spans.items()}

    @cached_property
    def _layer_shifts(self) -> dict[tuple[int, int], int]:
        """What to add to a chunk's saved layer indices: its offset when they restart at 0 (legacy
        Megatron), nothing when they are global already (some savers renumber layers)."""
        shifts, offset = {}, 0
        for chunk in self.chunk_order():
            first, count = self._layer_spans[chunk]
            if first == 0:
                shifts[chunk] = offset
            elif first == offset:
                shifts[chunk] = 0
            else:
                p, v = chunk
                raise CheckpointError(
                    f"{self._shown(0, p)} (chunk {v}): decoder layers start at {first}, neither 0 (local numbering) nor "
                    f"{offset} (global numbering after the chunks before it); the files are from different saves"
                )
            offset += count
        return shifts

    @cached_property
    def _entries(self) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        for p, v in self.chunk_order():
            shown = f"{self._shown(0, p)} (chunk {v})"
            for key, value in self.chunks(0, p)[v].items():
                mapped = resolve(key, self._table, shown)
                indices = mapped.indices
                if mapped.is_layer:
                    indices = (indices[0] + self._layer_shifts[(p, v)], *indices[1:])
                placements = [(indices, ())]
                if self._expert_rank and is_expert_row(mapped):
                    placements = self._expert_placements(p, v, indices, shown)
                for where, ranks in placements:
                    transform = self._make_transform(mapped, tuple(value.shape), len(ranks) or self.tp)
                    self._add_entries(entries, Entry("", p, v, key, "", transform, mapped, ranks), where, shown)
        return entries

    def _add_entries(self, entries: dict[str, Entry], template: Entry, indices: tuple[int, ...], shown: str) -> None:
        """One entry per part of `template`'s Megatron key, named with `indices` (global layer, expert)."""
        mapped, transform = template.mapped, template.transform
        names = self.hf_names(mapped, transform, shown, template.key, indices)
        for part, name in zip(transform.parts, names):
            if name in entries:
                other = entries[name]
                raise CheckpointError(
                    f"{shown}: {template.key} and {other.key} (in {self._shown(0, other.pp)} chunk {other.vpp}) both "
                    f"give {name}; the checkpoint holds a parameter twice: remove one or fix the mapping"
                )
            entries[name] = dataclasses.replace(template, name=name, part=part)

    # ---- expert parallelism --------------------------------------------------------------------

    def _expert_placements(self, p: int, v: int, indices: tuple[int, int], shown: str):
        """[((layer, global expert), TP ranks holding it)] for local expert `indices[1]` of chunk (p, v), one per
        expert-parallel rank E at stage p. Each rank numbers its experts from 0, so local expert L of rank E is
        global expert E * (experts per rank) + L, as megatron-core's `local_expert_indices`; the TP ranks that
        share E hold that expert's expert-tensor-parallel shards, in TP order (one rank when ETP = 1)."""
        per_rank = self._local_expert_count(p, v, shown)
        groups: dict[int, list[int]] = {}
        for t in range(self.tp):
            groups.setdefault(self._expert_rank[(t, p)], []).append(t)
        return [((indices[0], e * per_rank + indices[1]), tuple(ranks)) for e, ranks in sorted(groups.items())]

    def _local_expert_count(self, p: int, v: int, shown: str) -> int:
        """Experts per MoE layer in one rank's chunk (p, v): its local expert numbers are 0..count-1."""
        if (p, v) not in self._local_counts:
            mapped = [resolve(key, self._table, shown) for key in self.chunks(0, p)[v]]
            local = {m.indices[1] for m in mapped if is_expert_row(m)}
            self._local_counts[(p, v)] = max(local) + 1
        return self._local_counts[(p, v)]

    @cached_property
    def _local_counts(self) -> dict[tuple[int, int], int]:
        return {}

    def _ranks(self, entry: Entry) -> tuple[int, ...]:
        """The TP ranks whose files hold `entry`: every TP rank, or the ranks of its expert-parallel rank."""
        return entry.ranks or tuple(range(self.tp))

    def _check_expert_ranks(self) -> None:
        """With EP > 1 every expert-parallel rank must have a folder. verl's legacy manager saves on data-parallel
        rank 0 only, so when EP ranks fall on other data-parallel ranks their experts were never written
        (verl issue #2086): say so, rather than merge a model with experts missing."""
        experts = dimensions(self.config).get("num_experts")
        if not self._expert_rank or not experts:
            return
        for p, v in self.chunk_order():
            present = sorted({self._expert_rank[(t, p)] for t in range(self.tp)})
            per_rank = self._local_expert_count(p, v, f"{self._shown(0, p)} (chunk {v})")
            if per_rank * len(present) < experts or present != list(range(len(present))):
                raise CheckpointError(
                    f"{self.model_dir}: holds expert-parallel rank(s) {present} only ({per_rank} of {experts} experts "
                    f"per layer each, {self.hf_dir.join('config.json')}); verl's legacy Megatron checkpoint manager "
                    "saves on data-parallel rank 0 only, so the other expert ranks' experts were never written (verl "
                    "issue #2086): they cannot be recovered from this checkpoint; save with dist_ckpt and merge that"
                )

    # ---- the seam ------------------------------------------------------------------------------

    def _piece(self, tp_rank: int, entry: Entry) -> np.ndarray:
        state = self.chunks(tp_rank, entry.pp)[entry.vpp]
        if entry.key not in state:
            raise CheckpointError(
                f"{self._shown(tp_rank, entry.pp)}: chunk {entry.vpp} has no {entry.key} (TP rank 0 has it); the rank "
                "files come from different saves: re-copy the checkpoint"
            )
        return state[entry.key]

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        infos = {}
        for name, entry in self._entries.items():
            ranks = self._ranks(entry)
            piece = self._piece(ranks[0], entry)
            try:
                shape = entry.transform.global_shape(tuple(piece.shape), len(ranks), entry.part)
            except (ValueError, RuntimeError) as err:
                raise CheckpointError(f"{self._shown(ranks[0], entry.pp)}: {entry.key}: {err}") from None
            layout = f"{entry.transform!r} over TP {len(ranks)}: {entry.key}"
            if entry.ranks:
                layout += f" of {self._rank_dirs[(ranks[0], entry.pp)]} (expert-parallel rank)"
            infos[name] = TensorInfo(name, shape, dtype_of(piece), layout)
        return infos

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def check_round_trip(self, name: str, merged) -> int:
        """Compare each TP rank's saved piece (its `part` rows, vocabulary padding excluded) bit for bit
        with where the inverse transform puts it in `merged`, cast to `merged`'s dtype, in row blocks
        (`pieces` are those placements). Over q, k and v (gate and up) every saved element of a fused
        tensor is compared once. Returns the number of TP ranks compared."""
        super().check_round_trip(name, merged)
        return len(self._ranks(self._entries[name]))

    def pieces(self, name: str) -> Iterator[Piece]:
        """Each TP rank's slice of `name`, placed in the Hugging Face tensor (vocab padding cut off); a fused
        QKV slice comes as one view per query group, so reading rows never copies a rank's whole part."""
        entry = self._entries[name]
        transform = entry.transform
        info = self.tensors()[name]
        self._ready_for(name)
        position = 0
        what = f" ({entry.part} part)" if entry.part else ""
        ranks = self._ranks(entry)
        for i, t in enumerate(ranks):
            shown = f"{self._shown(t, entry.pp)}: {entry.key}{what} in model chunk {entry.vpp}"
            if transform.replicated:
                piece = transform.extract(self._piece(t, entry), entry.part)
                yield Piece(shown, (0,) * piece.ndim, tuple(piece.shape), piece, primary=i == 0)
                continue
            for view in transform.extract_views(self._piece(t, entry), entry.part):
                piece = transform.trim(view, i, len(ranks))
                offsets = [0] * piece.ndim
                offsets[transform.dim] = position
                position += piece.shape[transform.dim]
                sizes = list(info.shape)
                sizes[transform.dim] = piece.shape[transform.dim]
                yield Piece(shown, tuple(offsets), tuple(sizes), piece)

    def streams(self, name: str) -> bool:
        return bool(self.tensors()[name].shape)  # `pieces` place exactly the values `read` combines

    def input_files(self, names: Iterable[str] | None = None) -> list[Location]:
        if names is None:
            stages = range(self.pp)
        else:
            stages = sorted({self._entries[n].pp for n in names if n in self._entries})
        return [self.file(t, p) for p in stages for t in range(self.tp)]

    # ---- checks --------------------------------------------------------------------------------

    def validate(self, check_replicas: bool = False) -> None:
        """Everything checkable before writing: folder set, mapping, TP sizes, shapes, replicas, layers.

        TP-replicated tensors (norms, router, value head) are always compared across TP ranks: they are small.
        """
        config = self.config
        self._check_divisible(config)
        entries = self._entries
        self._check_same_keys()
        self._check_tp_size(entries)
        for name, entry in entries.items():
            self._check_shapes(entry)
        self._check_vocab(entries)
        self._check_expert_ranks()
        replicated = [entry for entry in entries.values() if entry.transform.replicated]
        self._make_ready([entry.name for entry in replicated])  # compared below: downloaded and CRC-checked
        for entry in replicated:
            self._check_replicated(entry)
        config_file = self.hf_dir.join("config.json")
        check_layers(self._entries, config, self.model_dir, config_file)
        check_moe(self.tensors(), config, self.model_dir, config_file)

    def _check_divisible(self, config: dict) -> None:
        where = self.hf_dir.join("config.json")
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads") or heads
        for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if isinstance(value, int) and value % self.tp:
                raise CheckpointError(
                    f"{where}: {field}={value} is not divisible by the tensor parallel size {self.tp} "
                    f"({self.tp} mp_rank folders in {self.model_dir}); the config is not this model's: pass "
                    "--hf_model_path with the right config"
                )

    def _check_same_keys(self) -> None:
        for p in range(self.pp):
            reference = self.chunks(0, p)
            for t in range(1, self.tp):
                chunks = self.chunks(t, p)
                for v, (mine, theirs) in enumerate(zip(chunks, reference)):
                    if set(mine) != set(theirs):
                        odd = sorted(set(mine) ^ set(theirs))[0]
                        where = "missing from" if odd in theirs else "only in"
                        raise CheckpointError(
                            f"{self._shown(t, p)}: {odd} (chunk {v}) is {where} this file ({self._shown(0, p)} differs); "
                            "the rank files come from different saves: re-copy the checkpoint"
                        )

    def _check_tp_size(self, entries: dict[str, Entry]) -> None:
        """The fused QKV rows imply the TP size: catches a missing highest TP rank folder."""
        for entry in entries.values():
            if entry.transform.kind != "qkv":
                continue
            transform = entry.transform
            rows = self._piece(0, entry).shape[0]
            full = transform.num_kv_heads * transform.group_rows
            if rows and full % rows == 0 and full // rows != self.tp:
                implied = full // rows
                suffix = f"_{entry.pp:03d}" if MP_RANK_DIR.match(self._rank_dirs[(0, entry.pp)])[2] else ""
                if implied > self.tp:
                    raise CheckpointError(
                        f"{self.model_dir.join(f'mp_rank_{self.tp:02d}{suffix}')}: missing ({entry.key} has {rows} rows "
                        f"per rank, which implies TP={implied}, but only {self.tp} TP rank folders exist); the save was "
                        "incomplete: copy every mp_rank_* folder"
                    )
            return

    def _check_shapes(self, entry: Entry) -> None:
        first_rank, *others = self._ranks(entry)
        first = self._piece(first_rank, entry)
        for t in others:
            piece = self._piece(t, entry)
            if piece.shape != first.shape or piece.dtype != first.dtype:
                raise CheckpointError(
                    f"{self._shown(t, entry.pp)}: {entry.key} is {tuple(piece.shape)} {dtype_of(piece)} here but "
                    f"{tuple(first.shape)} {dtype_of(first)} in {self._shown(first_rank, entry.pp)}; the rank files "
                    "come from different saves or TP sizes: re-copy the checkpoint"
                )
        if entry.transform.kind == "qkv":
            transform = entry.transform
            want = transform.num_kv_heads // self.tp * transform.group_rows
            if first.shape[0] != want:
                raise CheckpointError(
                    f"{self._shown(0, entry.pp)}: {entry.key} has {first.shape[0]} rows but {self.hf_dir.join('config.json')} "
                    f"implies {want} per TP rank ({transform!r}, TP {self.tp}); the checkpoint and config.json are "
                    "from different models (pass --hf_model_path with the right config)"
                )
        elif entry.transform.kind == "gated" and first.shape[0] % 2:
            raise CheckpointError(f"{self._shown(0, entry.pp)}: {entry.key} has an odd number of rows, not [gate; up]")

    def _check_vocab(self, entries: dict[str, Entry]) -> None:
        for entry in entries.values():
            if entry.transform.kind == "vocab":
                rows = self._piece(0, entry).shape[0] * self.tp
                if rows < entry.transform.vocab_size:
                    raise CheckpointError(
                        f"{self._shown(0, entry.pp)}: {entry.key} has {rows} rows over {self.tp} TP ranks, fewer than "
                        f"vocab_size={entry.transform.vocab_size} in {self.hf_dir.join('config.json')}; the config is "
                        "not this model's (pass --hf_model_path with the right config)"
                    )

    def _check_replicated(self, entry: Entry) -> None:
        first_rank, *others = self._ranks(entry)
        first = self._piece(first_rank, entry)
        for t in others:
            if not bitwise_equal(self._piece(t, entry), first):
                raise CheckpointError(
                    f"{self._shown(t, entry.pp)}: {entry.key} differs from its copy in "
                    f"{self._shown(first_rank, entry.pp)} "
                    "(TP-replicated tensors must be equal); the rank files come from different saves: re-copy them"
                )

    def describe(self) -> dict:
        return {
            "format": self.format_name,
            "location": str(self.location),
            "step": self.step,
            "role": self.location.name,
            "world_size": self.tp * self.pp,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "layers_per_chunk": [self.layers_per_chunk[c] for c in self.chunk_order()],
            "expert_ranks": {self._rank_dirs[k]: e for k, e in sorted(self._expert_rank.items())} or None,
            "files": [f"model/{self._rank_dirs[(t, p)]}/{MODEL_FILE}" for p in range(self.pp) for t in range(self.tp)],
            "custom_mapping": self.custom_mapping,
        }
