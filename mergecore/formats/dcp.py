"""Torch distributed checkpoints (DCP) of a Hugging Face model, as torch's `dcp.save` writes them for torchtitan,
Accelerate with FSDP (TRL) and any FSDP2 / HSDP / FSDP+TP trainer: a folder of `.metadata` and `__R_K.distcp` files.

Layouts found from the folder given (`formats.find_role_folder` descends to it):

- a `dcp.save` folder: `.metadata` and the data files, flat model keys (`model.embed_tokens.weight`);
- torchtitan: `RUN/checkpoint/step-N/` (the newest step unless one is named), flat keys; earlier steps also hold
  `optimizer.*`, `lr_scheduler.*`, `dataloader`, `train_state.*`, which are never read. A Hugging Face model
  trained by torchtitan keeps transformers' names; torchtitan's own models keep theirs (`tok_embeddings.weight`,
  `layers.N.attention.qkv_linear.wq.weight`), mapped by `families.torchtitan_maps` (Llama 3's q/k rows
  permuted per head for the Hub's rotary embedding);
- Accelerate `save_state` with FSDP's sharded state dict: `DIR/pytorch_model_fsdp_0/`, model keys under `model.`
  (`model.model.embed_tokens.weight`); `optimizer_0/` and the pickled `random_states_*.pkl` beside it are never read.

`.metadata` records every saved box of every tensor at its global offsets, whatever the placements were (FSDP2's
`Shard(0)`, HSDP's replicas saved once, FSDP+TP's `_StridedShard` and `Shard(1)`): each box is one piece, read as a
view of its mapped chunk (`dcp_chunks`), so a merge streams any tensor in row blocks within the memory budget, and
only the model's bytes are read, locally or by byte range from object storage. A DCP folder holds no config:
`--hf_model_path` names the Hugging Face folder (config.json, tokenizer files; its weights are never read).

>>> open_checkpoint("run/checkpoint/step-100", backend="dcp", hf_dir="hf/Llama-3.2-1B")  # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import cached_property

from ..errors import CheckpointError
from ..families.torchtitan_maps import Saved, hub_names, is_torchtitan_naming
from ..families.transforms import rows_placed
from ..storage import Location
from .base import CheckpointSource, Piece, TensorInfo, read_hf_config
from .dcp_chunks import DcpChunks
from .dcp_metadata import load_dcp_metadata
from .detect import ACCELERATE_MODEL_DIR, DIST_METADATA_FILE
from .fetching import FetchesByGroup
from .untrusted import DCP_RECORDS

# Keys of a training state that are not the model's (torchtitan's, Accelerate's, DCP's own `state_dict` helpers).
NOT_MODEL = ("optimizer.", "optim.", "lr_scheduler", "dataloader", "train_state", "rng")


class DcpCheckpoint(DcpChunks, FetchesByGroup, CheckpointSource):
    format_name = "torch-dcp"

    def __init__(self, location: Location, hf_dir: Location | None = None, step: int | None = None):
        self.location = location
        self.hf_dir = hf_dir or location.join("huggingface")  # none there: read_hf_config names --hf_model_path
        self.step = step
        self.metadata = load_dcp_metadata(location.join(DIST_METADATA_FILE))
        self.key_prefix = "model." if ACCELERATE_MODEL_DIR.match(location.name) else ""
        self.layout = "accelerate" if self.key_prefix else "torchtitan" if re.match(r"^step-\d+$", location.name) \
            else "dcp"

    @property
    def dcp_dir(self) -> Location:
        return self.location

    @cached_property
    def _tensor_keys(self) -> dict[str, object]:
        """Model tensor keys (bytes, optimizer state and other training state dropped)."""
        tensor = DCP_RECORDS["TensorStorageMetadata"]
        return {key: md for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, tensor) and key.startswith(self.key_prefix) and not key.startswith(NOT_MODEL)}

    @cached_property
    def _saved(self) -> dict[str, Saved]:
        """Hugging Face name -> where it is saved: transformers' names as they are, or torchtitan's own names
        through its table (`torchtitan_maps`: rows a transform reorders, grouped experts split along dim 0)."""
        names = {key[len(self.key_prefix):]: key for key in self._tensor_keys}
        if not is_torchtitan_naming(names):
            return {name: Saved(key) for name, key in names.items()}
        shapes = {name: tuple(int(s) for s in self._tensor_keys[key].size) for name, key in names.items()}
        titan = hub_names(shapes, read_hf_config(self), str(self.dcp_dir.join(DIST_METADATA_FILE)))
        return {name: saved._replace(key=names[saved.key]) for name, saved in titan.items()}

    @cached_property
    def _keys(self) -> dict[str, str]:
        """Hugging Face name -> DCP key."""
        return {name: saved.key for name, saved in self._saved.items()}

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        infos = {}
        for name, (key, transform, expert) in self._saved.items():
            md = self._tensor_keys[key]
            shape = tuple(int(s) for s in md.size)[0 if expert is None else 1:]
            layout = _split(self._chunk_files.get(key, []))
            if key != name:
                layout += "; torchtitan's name" + (f", rows {transform!r}" if transform else "") + \
                    (", one expert of its grouped experts" if expert is not None else "")
            if transform:
                try:
                    transform.row_map(shape[0])
                except ValueError as err:
                    raise CheckpointError(f"{self.dcp_dir.join(DIST_METADATA_FILE)}: {key}: {err}; --hf_model_path "
                                          "describes another model than the one trained: pass its config") from None
            infos[name] = TensorInfo(name, shape, md.properties.dtype, layout)
        return infos

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def pieces(self, name: str) -> Iterator[Piece]:
        """Every saved box of `name` at its global offsets, a view of its mapped chunk (each saved once: DCP
        writes a replicated box from one rank only)."""
        key, transform, expert = self._saved[name]
        self._ready_for(name)
        for offsets, sizes, info in self._chunk_files.get(key, []):
            source, box = f"{self.dcp_dir.join(info.relative_path)}: {key}", self._chunk_array(info, sizes)
            if expert is not None:  # the expert's slice of a box holding it, without the experts' dim
                if not offsets[0] <= expert < offsets[0] + sizes[0]:
                    continue
                source, box, offsets, sizes = f"{source}[{expert}]", box[expert - offsets[0]], offsets[1:], sizes[1:]
            if transform is None:
                yield Piece(source, offsets, sizes, box)
                continue
            for box_rows, target in rows_placed(offsets[0], sizes[0], transform.row_map(self._infos[name].shape[0])):
                rows = box[box_rows]
                yield Piece(source, (target, *offsets[1:]), tuple(rows.shape), rows)

    def input_files(self, names: Iterable[str] | None = None) -> list[Location]:
        keys = self._tensor_keys if names is None else [self._keys[n] for n in names if n in self._keys]
        files = {info.relative_path for key in keys for *_, info in self._chunk_files.get(key, [])}
        return [self.dcp_dir.join(f) for f in sorted(files)]

    def _fetchable_names(self):
        return self._keys

    def _download(self, names: list[str]) -> None:
        keys = {self._keys[n] for n in names}  # an expert's key: the grouped tensor's boxes holding it
        self._download_boxes([(key, (0,) * len(size), size) for key, size in self._saved_sizes(keys)])

    def _saved_arrays(self, names: list[str]):
        return [self._chunk_array(info, sizes) for n in names for _, sizes, info in self._chunk_files.get(self._keys[n], [])]

    def validate(self, check_replicas: bool = False) -> None:
        """Model tensors are there, each wholly covered by its saved boxes (`dcp_metadata` bounds the counts)."""
        shown = self.dcp_dir.join(DIST_METADATA_FILE)
        if not self._tensor_keys:
            found = ", ".join(sorted(self.metadata.state_dict_metadata)[:3]) or "nothing"
            raise CheckpointError(f"{shown}: holds no model tensors (found {found}); point --local_dir at the folder "
                                  "of the model's save (torchtitan: checkpoint/step-N; Accelerate: "
                                  "pytorch_model_fsdp_0)")
        for key, size in self._saved_sizes(set(self._keys.values())):
            held = sum(_count(sizes) for _, sizes, _ in self._chunk_files.get(key, []))
            if held != _count(size):
                raise CheckpointError(f"{shown}: {key} has {held} of {_count(size)} elements "
                                      "saved; the save is incomplete: copy the whole checkpoint folder again")

    def _saved_sizes(self, keys) -> list[tuple[str, tuple[int, ...]]]:
        """(key, its saved global shape) of each of `keys`, in a stable order."""
        return [(key, tuple(int(s) for s in self._tensor_keys[key].size)) for key in sorted(keys)]

    def describe(self) -> dict:
        files = self._data_files()
        return {"format": self.format_name, "location": str(self.location), "step": self.step,
                "role": self.location.name, "layout": self.layout, "world_size": len(files),
                "mesh_shape": [len(files)], "files": files}


def _split(chunks) -> str:
    """How the saved boxes cut a tensor, dimension by dimension: what `.metadata` keeps of the placements (FSDP2's
    Shard(0): along dim 0; FSDP+TP's row-parallel (Shard(0), Shard(1)): along dims 0 and 1; a strided shard looks
    like an even cut).

    >>> _split([((0, 0), (2, 4), None), ((2, 0), (2, 4), None)]), _split([((0,), (3,), None)])
    ('DCP: 2 boxes, cut along dim 0 (2)', 'DCP: 1 box, whole')
    """
    cuts = [len({offsets[d] for offsets, _, _ in chunks}) for d in range(len(chunks[0][0]))] if chunks else []
    along = ", ".join(f"dim {d} ({n})" for d, n in enumerate(cuts) if n > 1)
    return f"DCP: {len(chunks)} box{'es' * (len(chunks) != 1)}, " + (f"cut along {along}" if along else "whole")


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
