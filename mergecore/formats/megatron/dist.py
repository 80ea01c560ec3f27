"""Megatron dist_ckpt checkpoints (torch_dist backend), read without megatron-core and without a process group.

Layouts found from the role folder (`.../global_step_N/actor`):

- verl 0.9.1: `model/dist_ckpt/` + `model/huggingface/` (and `optimizer/`, `extra/`, `ckpt_contents.json`,
  `transformer_config.json`, which are not read);
- older verl: `dist_ckpt/` + `huggingface/` at the role folder.

A dist_ckpt folder holds `.metadata` (a pickled torch DCP `Metadata`: global shapes, saved chunks and
where their bytes are), `__R_K.distcp` data files, `common.pt` and `metadata.json`
(`"sharded_backend": "torch_dist"`). Global tensors do not depend on the training TP/PP/VPP sizes:
each is the TP=1 tensor, so the mapping tables of `mergecore.families.megatron_maps` and the transforms of
`mergecore.families.transforms` apply with `tp=1` (fc1 is `[gate; up]`, QKV rows are per query group, vocab
rows padded).

Decoder layers of a homogeneous model are stacked on a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` is `[L, rows, hidden]`); MoE experts add an expert
axis after it (`decoder.layers.mlp.experts.experts.linear_fc1.weight` is `[L, E, 2*ffn, hidden]`).
Heterogeneous models use per-layer keys `decoder.layers.<i>.<suffix>`. Every such slice is given a
legacy-style name (`decoder.layers.<i>.<suffix>`, experts `...local_experts.<e>...`) and resolved with
the same tables as legacy checkpoints.

Only the byte ranges of the rows being merged are read: every stored chunk is a numpy view of its
mmapped `.distcp` file, and `pieces` places each chunk's part rows (`Transform.row_map`) in the Hugging
Face tensor, so `read_rows` streams any tensor in row blocks within the chunk budget
(`mergecore.numbers.budget`); optimizer state or extra state sharing the files is never touched. `.metadata` and `common.pt`
are untrusted: they are unpickled with allow-lists, never with plain pickle (`.metadata` is loaded and bounded by
the folder's bytes in `formats/dcp_metadata.py`, its chunks read by `formats/dcp_chunks.py`; `common.pt` goes
through the Megatron allow-list of `legacy.py`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...errors import CheckpointError
from ...families.megatron_maps import SKIPPED, Mapped, resolve
from ...storage import Location
from ...storage.tensorio import read_json
from ...numbers.arrays import numpy_dtype
from ...families.transforms import Transform, rows_placed
from ..base import CheckpointSource, Piece, TensorInfo
from ..detect import DIST_METADATA_FILE, dist_ckpt_dir
from ..dcp_chunks import DcpChunks
from ..dcp_metadata import load_dcp_metadata
from ..fetching import FetchesByGroup
from .checks import check_layers, check_moe
from .common import MegatronReader
from ..untrusted import DCP_RECORDS

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "encoder.", "mtp.")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# the expert axis of MoE weights in dist_ckpt: `mlp.experts.experts.linear_fc1.weight` (SequentialMLP and
# TEGroupedMLP save under the same key); also accepted without the second `experts.`
_EXPERTS = re.compile(r"^mlp\.experts\.(?:experts\.|local_experts\.)?(linear_fc[12]\.(?:weight|bias))$")


# ---- the index: HF name -> which box of which key --------------------------------------------

@dataclass(frozen=True)
class Slice:
    """One legacy-style Megatron tensor inside a dist_ckpt key: `key[index]`."""

    key: str
    index: tuple[int, ...]
    legacy_key: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16"
    position: int  # the key's position in the metadata (save order)


@dataclass(frozen=True)
class Entry:
    name: str
    slice: Slice
    part: str
    transform: Transform
    mapped: Mapped


class MegatronDistCheckpoint(MegatronReader, DcpChunks, FetchesByGroup, CheckpointSource):
    format_name = "verl-megatron-dist"

    @property
    def dcp_dir(self) -> Location:
        return self.dist_dir

    def __init__(self, location: Location, hf_dir: Location | None = None, step: int | None = None,
                 custom_mapping: str | None = None):
        self.location = location
        dist = dist_ckpt_dir(location)
        if dist is None:
            raise CheckpointError(
                f"{location}: has no model/dist_ckpt or dist_ckpt folder with a .metadata file; point --local_dir at "
                "the actor/critic folder of a verl Megatron dist_ckpt checkpoint"
            )
        self.dist_dir = dist
        if hf_dir is None:
            candidates = [dist.parent.join("huggingface"), location.join("huggingface"), location.join("model", "huggingface")]
            hf_dir = next((c for c in candidates if c.join("config.json").exists()), candidates[0])
        self.hf_dir = hf_dir
        self.step = step
        self.custom_mapping = Location.of(custom_mapping).url if custom_mapping else None  # absolute: kept in manifests
        self._check_backend()
        self.metadata = load_dcp_metadata(dist.join(DIST_METADATA_FILE))

    # ---- discovery -----------------------------------------------------------------------------

    def _check_backend(self) -> None:
        where = self.dist_dir.join("metadata.json")
        if not where.exists():
            raise CheckpointError(f"{where}: missing; the dist_ckpt save was incomplete: copy the whole folder again")
        info = read_json(where, fix="copy it again from where training saved it")
        backend = info.get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(
                f"{where}: sharded_backend is {backend!r}; only the torch_dist backend is supported (convert zarr "
                "checkpoints with megatron-core's dist_checkpointing first)"
            )
        self.backend_info = info

    @cached_property
    def _tensor_keys(self) -> dict[str, object]:
        """Model tensor keys of the metadata (extra state, bytes and non-model keys dropped)."""
        keys = {}
        for key, md in self.metadata.state_dict_metadata.items():
            name = _model_key(key)
            if not name.startswith(MODEL_PREFIXES) or "._extra_state" in name or SKIPPED.search(name):
                continue
            if not isinstance(md, DCP_RECORDS["TensorStorageMetadata"]):
                continue  # ShardedObjects (bytes)
            keys[key] = md
        return keys

    @cached_property
    def _slices(self) -> list[Slice]:
        slices = []
        for position, (key, md) in enumerate(self._tensor_keys.items()):
            name = _model_key(key)
            shape = tuple(int(s) for s in md.size)
            dtype = md.properties.dtype
            stacked, per_layer = _STACKED.match(name), _PER_LAYER.match(name)
            if stacked or per_layer:
                suffix = stacked[1] if stacked else per_layer[2]
                expert = _EXPERTS.match(suffix)
                lead = (1 if stacked else 0) + (1 if expert else 0)
                if len(shape) <= lead:
                    raise CheckpointError(
                        f"{self.dist_dir.join(DIST_METADATA_FILE)}: {key} has shape {shape}, too few dimensions for its "
                        f"{'layer and expert' if lead == 2 else 'layer' if stacked else 'expert'} axes"
                    )
                ranges = [range(shape[d]) for d in range(lead)]
                for index in itertools.product(*ranges):
                    layer = index[0] if stacked else int(per_layer[1])
                    if expert:
                        e = index[-1]
                        legacy = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{expert[1]}"
                    else:
                        legacy = f"decoder.layers.{layer}.{suffix}"
                    slices.append(Slice(key, index, legacy, shape[lead:], dtype, position))
            else:
                slices.append(Slice(key, (), name, shape, dtype, position))
        return slices

    def saved_parameters(self) -> dict[str, str]:
        return {s.legacy_key: s.key for s in self._slices}

    def _output_rows(self) -> int | None:
        return next((s.shape[0] for s in self._slices if s.legacy_key == "output_layer.weight"), None)

    @cached_property
    def _entries(self) -> dict[str, Entry]:
        shown = str(self.dist_dir.join(DIST_METADATA_FILE))
        found: list[tuple[tuple, Entry]] = []
        seen: dict[str, Slice] = {}
        for s in self._slices:
            mapped = resolve(s.legacy_key, self._table, f"{shown}: {s.key}")
            transform = self._make_transform(mapped, s.shape)
            names = self.hf_names(mapped, transform, shown, s.key)
            for order, (part, name) in enumerate(zip(transform.parts, names)):
                if name in seen:
                    raise CheckpointError(
                        f"{shown}: {s.key} and {seen[name].key} both give {name}; the checkpoint holds a parameter "
                        "twice: fix the mapping"
                    )
                seen[name] = s
                found.append((_hf_order(s, order), Entry(name, s, part, transform, mapped)))
        found.sort(key=lambda item: item[0])
        return {entry.name: entry for _, entry in found}

    # ---- reading -------------------------------------------------------------------------------

    def _slice_array(self, s: Slice) -> np.ndarray:
        """`key[index]` as numpy: a view of the mapped chunk when one chunk holds it (a stacked key's layer
        always is), else copied together from the chunks that overlap it. Only that box's bytes are read: DCP
        stores each chunk as a torch.save archive at a byte range of a .distcp file, and torch's own reader
        would load whole chunks (for a stacked `[L, ...]` key, every layer for each layer)."""
        box_offsets, box_sizes = self._box(s)
        dest = None
        for low, high, chunk, inside, _ in self._overlapping_chunks(s.key, box_offsets, box_sizes):
            if dest is None and [hi - lo for lo, hi in zip(low, high)] == list(box_sizes):
                return chunk[inside].reshape(s.shape)
            if dest is None:
                dest = np.empty(box_sizes, dtype=numpy_dtype(s.dtype))
            dest[tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, box_offsets))] = \
                chunk[inside]
        if dest is None:
            raise CheckpointError(f"{self.dist_dir.join(DIST_METADATA_FILE)}: no chunk of {s.key} holds {s.index}; "
                                  "the metadata is damaged: copy the dist_ckpt folder again")
        return dest.reshape(s.shape)

    def _box(self, s: Slice) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of `key[index]` within the key's global tensor."""
        full = tuple(int(x) for x in self.metadata.state_dict_metadata[s.key].size)
        lead = len(s.index)
        return (*s.index, *([0] * (len(full) - lead))), (*([1] * lead), *full[lead:])

    def _fetchable_names(self):
        return self._entries

    def _download(self, names: list[str]) -> None:
        self._download_boxes([(entry.slice.key, *self._box(entry.slice)) for entry in map(self._entries.get, names)])

    def _saved_arrays(self, names: list[str]):
        return [chunk for entry in (self._entries[name] for name in names)
                for _, _, chunk, _, _ in self._overlapping_chunks(entry.slice.key, *self._box(entry.slice))]

    def _files_for(self, s: Slice) -> list[Location]:
        files = []
        for offsets, sizes, info in self._chunk_files.get(s.key, []):
            if all(o <= i < o + n for i, o, n in zip(s.index, offsets, sizes)):
                files.append(self.dist_dir.join(info.relative_path))
        return files

    # ---- the seam ------------------------------------------------------------------------------

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        infos = {}
        for name, entry in self._entries.items():
            s = entry.slice
            try:
                shape = entry.transform.global_shape(s.shape, 1, entry.part)
            except (ValueError, RuntimeError) as err:
                raise CheckpointError(f"{self.dist_dir.join(DIST_METADATA_FILE)}: {s.key}: {err}") from None
            where = s.key + (f"[{', '.join(map(str, s.index))}]" if s.index else "")
            layout = f"{entry.transform!r} (dist_ckpt global tensor): {where}"
            infos[name] = TensorInfo(name, tuple(shape), s.dtype, layout)
        return infos

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def check_round_trip(self, name: str, merged) -> int:
        """Compare `merged` with the saved slice of the global Megatron tensor (its `part` rows, vocabulary
        padding excluded), bit for bit in `merged`'s dtype.

        dist_ckpt holds TP=1 global tensors, so the inverse transform at TP=1 is the identity on the part:
        each stored chunk's part rows (`pieces`) are compared with where they sit in `merged`, in row
        blocks; `merged`, a read-only view of the output file, is never copied. Returns 1 (one saved slice).
        """
        super().check_round_trip(name, merged)
        return 1

    def pieces(self, name: str) -> Iterator[Piece]:
        """The saved rows of `name`, as views of the mapped `.distcp` chunks placed in the Hugging Face tensor:
        one piece per stored chunk and run of part rows (a fused QKV part comes as one run per query group;
        vocabulary padding is left out). Reading rows of the merged tensor touches only those rows' bytes."""
        entry = self._entries[name]
        s, transform = entry.slice, entry.transform
        box_offsets, box_sizes = self._box(s)
        lead = len(s.index)
        what = f" ({entry.part} part)" if entry.part else ""
        where = f"[{', '.join(map(str, s.index))}]" if s.index else ""
        runs = transform.row_map(s.shape[0], entry.part) if s.shape else []
        self._ready_for(name)
        found = False
        for low, high, chunk, inside, info in self._overlapping_chunks(s.key, box_offsets, box_sizes):
            found = True
            view = chunk[inside][(0,) * lead + (...,)]  # the slice's own axes (a view; `...` keeps a 0-d one an array)
            start = [lo - b for lo, b in zip(low[lead:], box_offsets[lead:])]
            source = f"{self.dist_dir.join(info.relative_path)}: {s.key}{where}{what}"
            if not s.shape:
                yield Piece(source, (), (), view)
                continue
            for box_rows, target in rows_placed(start[0], view.shape[0], runs):
                rows = view[box_rows]
                yield Piece(source, (target, *start[1:]), tuple(rows.shape), rows)
        if not found:
            raise CheckpointError(f"{self.dist_dir.join(DIST_METADATA_FILE)}: no chunk of {s.key} holds {s.index}; "
                                  "the metadata is damaged: copy the dist_ckpt folder again")

    def streams(self, name: str) -> bool:
        return bool(self.tensors()[name].shape)  # `pieces` place exactly the saved rows of each part

    def input_files(self, names: Iterable[str] | None = None) -> list[Location]:
        entries = self._entries.values() if names is None else [self._entries[n] for n in names if n in self._entries]
        files: dict[str, Location] = {}
        for entry in entries:
            for location in self._files_for(entry.slice):
                files[location.url] = location
        return [files[k] for k in sorted(files)]

    # ---- checks --------------------------------------------------------------------------------

    def validate(self, check_replicas: bool = False) -> None:
        """Metadata against config.json (layers, heads, hidden size, vocab), mapping, storage index."""
        config = self.config
        shown = self.dist_dir.join(DIST_METADATA_FILE)
        where = self.hf_dir.join("config.json")
        if not self._tensor_keys:
            raise CheckpointError(f"{shown}: holds no model tensors (embedding.*, decoder.*, output_layer.*); it is not a "
                                  "model dist_ckpt (optimizer/ or extra/?): point --local_dir at the role folder")
        hidden = config.get("hidden_size")
        layers = config.get("num_hidden_layers")
        for key, md in self._tensor_keys.items():
            shape = tuple(int(s) for s in md.size)
            if _STACKED.match(_model_key(key)) and isinstance(layers, int) and shape[0] != layers:
                raise CheckpointError(
                    f"{shown}: {key} stacks {shape[0]} decoder layers but num_hidden_layers={layers} in {where}; the "
                    "checkpoint and config.json are from different models (pass --hf_model_path with the right config)"
                )
        entries = self._entries
        for entry in entries.values():
            s, transform = entry.slice, entry.transform
            if transform.kind == "qkv" and entry.part == "q":
                want = transform.num_kv_heads * transform.group_rows
                if s.shape[0] != want:
                    raise CheckpointError(
                        f"{shown}: {s.key} has {s.shape[0]} rows per layer but {where} implies {want} ({transform!r}: "
                        "num_attention_heads, num_key_value_heads, head_dim); the checkpoint and config.json are from "
                        "different models (pass --hf_model_path with the right config)"
                    )
            if transform.kind in ("qkv", "vocab", "gated") and len(s.shape) == 2 and isinstance(hidden, int) \
                    and s.shape[1] != hidden and entry.part in ("", "q", "gate"):
                raise CheckpointError(
                    f"{shown}: {s.key} has {s.shape[1]} columns but hidden_size={hidden} in {where}; the checkpoint and "
                    "config.json are from different models (pass --hf_model_path with the right config)"
                )
            if transform.kind == "vocab" and s.shape[0] < transform.vocab_size:
                raise CheckpointError(
                    f"{shown}: {s.key} has {s.shape[0]} rows, fewer than vocab_size={transform.vocab_size} in {where}; "
                    "the config is not this model's (pass --hf_model_path with the right config)"
                )
            if transform.kind == "gated" and s.shape[0] % 2:
                raise CheckpointError(f"{shown}: {s.key} has an odd number of rows, not [gate; up]")
        check_layers(entries, config, self.dist_dir, where)
        check_moe(self.tensors(), config, self.dist_dir, where)
        self.common  # noqa: B018 - common.pt is refused here if it is not a plain checkpoint pickle
        self.tensors()

    @cached_property
    def common(self) -> dict:
        """`common.pt` (non-sharded state: iteration, args...), through the Megatron allow-list."""
        from .legacy import load_model_file

        location = self.dist_dir.join("common.pt")
        if not location.exists():
            return {}
        loaded = load_model_file(location.local_file(), str(location))
        return loaded if isinstance(loaded, dict) else {}

    def describe(self) -> dict:
        layered = {int(s.legacy_key.split(".")[2]) for s in self._slices if s.legacy_key.startswith("decoder.layers.")}
        files = self._data_files()
        iteration = self.common.get("iteration")
        return {
            "format": self.format_name,
            "location": str(self.location),
            "step": self.step,
            "role": self.location.name,
            "world_size": len(files),
            "dist_ckpt": str(self.dist_dir),
            "sharded_backend": self.backend_info.get("sharded_backend"),
            "stacked_layers": any(_STACKED.match(_model_key(k)) for k in self._tensor_keys),
            "layers": len(layered),
            "iteration": iteration if isinstance(iteration, int) else None,
            "files": [f"{self.dist_dir.name}/{f}" for f in files],
            "custom_mapping": self.custom_mapping,
        }


def _model_key(key: str) -> str:
    """A metadata key without the `module.` prefixes of wrapped models."""
    while key.startswith("module."):
        key = key[len("module."):]
    return key


def _hf_order(s: Slice, part: int) -> tuple:
    """Hugging Face order: embedding, layers in order (experts in order), final norm, output head."""
    match = re.match(r"decoder\.layers\.(\d+)\.", s.legacy_key)
    if s.legacy_key.startswith("embedding."):
        group = (0, 0)
    elif match:
        group = (1, int(match[1]))
    elif s.legacy_key.startswith("decoder."):
        group = (2, 0)
    else:
        group = (3, 0)
    expert = s.index[1:] if _STACKED.match(_model_key(s.key)) else s.index
    return (*group, s.position, tuple(expert), part)
