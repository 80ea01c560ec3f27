"""The Hub's on-disk layout of a checkpoint that holds transformers' in-memory layout, asked of transformers.

transformers 5 converts some models on load (Qwen3-MoE experts packed into `mlp.experts.gate_up_proj`,
Qwen2.5-VL under `model.language_model.` / `model.visual.`) and reverts that on `save_pretrained` with
`transformers.core_model_loading.revert_weight_conversion`. FSDP rank files hold the in-memory layout.
We run that very function on meta tensors (no memory) with `.contiguous()` turned into a no-op, so every
output stays a *view* of its source; each view's geometry is then read back as a box of one source tensor.
Each output tensor is thus computed from one source slice: streamable one tensor at a time.
Outputs the conversion builds with `torch.cat` / `torch.stack` (Sarvam-MoE's fused `query_key_value` from
`q_proj`, `k_proj`, `v_proj`) are recorded as they are built and read back as `HubParts`: boxes of several
sources side by side, each read on its own, row block by row block. Reverse conversions that reorder
elements (interleaving, transposes) are refused (see docs/hub_layout.md).

>>> slices = hub_slices(config, {"model.layers.0.mlp.experts.gate_up_proj": (4, 64, 64)})  # doctest: +SKIP
>>> slices["model.layers.0.mlp.experts.1.up_proj.weight"]                                   # doctest: +SKIP
HubSlice(source='model.layers.0.mlp.experts.gate_up_proj', start=(1, 32, 0), stop=(2, 64, 64), dims=(1, 2))
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from ..errors import CheckpointError
from ..formats.base import CheckpointSource, Piece, TensorInfo, read_hf_config
from ..families.layout import _PATTERNS
from ..families.meta_model import meta_model
from ..numbers.arrays import to_numpy


@dataclass(frozen=True)
class HubSlice:
    """Output tensor = `source[start:stop]` with the source dims not in `dims` squeezed (each of size 1).

    `dims[j]` is the source dim output dim j runs along, or None for an output dim of size 1; dims in another
    order than the source's are a transpose. `reorder`, when given, is `(j, order)`: along output dim j, index i
    holds the box's index `order[i]` (a permutation: Kimi-K2.5's vision q/k rows, Inkling's interleaved experts).
    """

    source: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    dims: tuple[int | None, ...]
    reorder: tuple[int, tuple[int, ...]] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(1 if d is None else self.stop[d] - self.start[d] for d in self.dims)

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        return self.start == (0,) * len(source_shape) and self.stop == tuple(source_shape) and \
            self.dims == tuple(range(len(source_shape))) and self.reorder is None


@dataclass(frozen=True)
class HubParts:
    """Output tensor = several `HubSlice`s side by side (what `torch.cat` / `torch.stack` of them builds in
    transformers' save conversion): part i fills the box of its own shape that starts at `offsets[i]`.

    >>> q = HubSlice("q_proj.weight", (0, 0), (64, 64), (0, 1))
    >>> k = HubSlice("k_proj.weight", (0, 0), (32, 64), (0, 1))
    >>> HubParts((q, k), ((0, 0), (64, 0)), (96, 64)).sources
    ('q_proj.weight', 'k_proj.weight')
    """

    parts: tuple[HubSlice, ...]
    offsets: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(part.source for part in self.parts)

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        return False


def sources_of(hub: HubSlice | HubParts) -> tuple[str, ...]:
    """The saved tensors an output is read from, in the order its parts are placed."""
    return hub.sources if isinstance(hub, HubParts) else (hub.source,)


def _first_source(hub: HubSlice | HubParts) -> str:
    """The saved tensor whose dtype and layout an output reports (a joined output's parts share the dtype: validate)."""
    return hub.source if isinstance(hub, HubSlice) else hub.parts[0].source


def needs_transformers(names) -> bool:
    """False when every name is already a known Hub decoder name: no need to import transformers."""
    return not all(any(regex.match(name) for regex, _ in _PATTERNS) for name in names)


def hub_slices(config: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, HubSlice | HubParts] | None:
    """Output name -> HubSlice (or HubParts), in source order, as `save_pretrained` of the model would name and shape
    them; None when transformers converts nothing for this model (names are already the Hub's). The model is the
    family's own (`mergecore.families.meta_model`), shared with the config check.
    """
    if not needs_transformers(shapes):
        return None
    model = meta_model(config)
    if model is None:
        return None
    import torch

    from transformers.core_model_loading import revert_weight_conversion

    sources = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    built: dict[int, tuple] = {}
    with _ViewsOnly(built):
        reverted = revert_weight_conversion(model, dict(sources))
    if set(reverted) == set(sources) and all(reverted[n] is sources[n] for n in sources):
        return None
    by_id = {id(t): name for name, t in sources.items()}
    slices, reordered = {}, []
    for name, tensor in reverted.items():
        try:
            slices[name] = _as_box(name, tensor, by_id, built)
        except _NotABox:
            reordered.append(name)
    if reordered:
        slices.update(_reordered_boxes(model, shapes, slices, reordered))
    order = {name: i for i, name in enumerate(shapes)}

    def first_saved(item):  # where an output's first part sits among the saved tensors
        hub = item[1].parts[0] if isinstance(item[1], HubParts) else item[1]
        return order[hub.source], hub.start

    slices = dict(sorted(slices.items(), key=first_saved))
    _check_coverage(slices, shapes)
    return slices


class _ViewsOnly:
    """A torch function mode in which `.contiguous()` returns its input, so slices stay views, and every
    `torch.cat` / `torch.stack` result is recorded in `built` (id -> (kind, dim, inputs, result)), so an output
    joined from several tensors can be traced back to them."""

    def __init__(self, built: dict | None = None):
        self.built = {} if built is None else built

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode

        joins = {torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat", torch.stack: "stack"}
        built = self.built

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.contiguous:
                    return args[0]
                result = func(*args, **(kwargs or {}))
                if func in joins:
                    inputs, dim = _join_arguments(args, kwargs or {})
                    built[id(result)] = (joins[func], dim, inputs, result)  # the result kept: its id stays its own
                return result

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _join_arguments(args: tuple, kwargs: dict) -> tuple[list, int]:
    """(input tensors, dim) of a `torch.cat` / `torch.stack` call, however it was spelled."""
    inputs = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    return list(inputs), dim


def _as_box(name: str, tensor, by_id: dict[int, str], built: dict[int, tuple]) -> HubSlice | HubParts:
    """Where output `name` comes from: one box of a saved tensor, or boxes of several saved tensors side by
    side when the conversion joined them (`torch.cat` / `torch.stack`, recorded in `built`)."""
    if id(tensor) not in built:
        return _as_slice(name, tensor, by_id)
    kind, dim, inputs, result = built[id(tensor)]
    dim = dim % result.dim()
    parts, offsets, along = [], [], 0
    for item in inputs:
        if kind == "cat" and item.dim() == 1 and item.shape[0] == 0 and result.dim() > 1:
            continue  # torch.cat's legacy skip of empty 1-D inputs
        box = _as_box(name, item, by_id, built)
        inner_parts, inner_offsets = (box.parts, box.offsets) if isinstance(box, HubParts) else ((box,), ((0,) * item.dim(),))
        for part, at in zip(inner_parts, inner_offsets):
            if kind == "stack":  # a new output dim of size 1 for each input, at `dim`
                part = HubSlice(part.source, part.start, part.stop, part.dims[:dim] + (None,) + part.dims[dim:])
                at = at[:dim] + (along,) + at[dim:]
            else:
                at = at[:dim] + (at[dim] + along,) + at[dim + 1:]
            parts.append(part)
            offsets.append(at)
        along += 1 if kind == "stack" else item.shape[dim]
    return HubParts(tuple(parts), tuple(offsets), tuple(result.shape))


class _NotABox(Exception):
    """An output the save conversion computed (no view of a saved tensor): asked again with index tensors."""


def _as_slice(name: str, tensor, by_id: dict[int, str]) -> HubSlice:
    root = tensor if id(tensor) in by_id else tensor._base
    if root is None or id(root) not in by_id:
        raise _NotABox(name)
    source = by_id[id(root)]
    shape = tuple(root.shape)
    contiguous = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * shape[d + 1]
    offset = tensor.storage_offset()
    start = [(offset // c) % s if s else 0 for c, s in zip(contiguous, shape)]
    stop = [i + 1 for i in start]
    dims = []
    for size, stride in zip(tensor.shape, tensor.stride()):
        if size == 1:
            dims.append(None)
            continue
        # any source dim not used yet: a transpose (Ergo's `gate_kernel`) is a box read along permuted dims
        d = next((d for d in range(len(shape)) if d not in dims and contiguous[d] == stride and shape[d] >= size),
                 None)
        if d is None:
            raise _NotABox(name)
        stop[d] = start[d] + size
        dims.append(d)
    if sum(i * c for i, c in zip(start, contiguous)) != offset:
        raise CheckpointError(f"{name}: transformers' save conversion is not a box of {source}; please report this")
    return HubSlice(source, tuple(start), tuple(stop), tuple(dims))


def _reordered_boxes(model, shapes: dict[str, tuple[int, ...]], slices: dict, names: list[str]) -> dict:
    """The outputs the save conversion computes by moving elements (PermuteForRope, Interleave), read back from
    the conversion run on index tensors, every saved element numbered: each a box of one saved tensor permuted
    along one dim, or such boxes side by side. Only the saved tensors the boxes found so far leave uncovered are
    numbered, one layer at a time (a layer's tensors together: a conversion joins tensors of one module)."""
    import torch

    from transformers.core_model_loading import revert_weight_conversion

    covered = _volumes(slices.values(), shapes)
    left = [name for name, shape in shapes.items() if covered[name] != math.prod(shape)]
    found: dict[str, HubSlice | HubParts] = {}
    for group in _by_layer(left):
        first, numbered, base = [], {}, 1  # numbered from 1: an element the conversion makes up (zeros) is no one's
        for name in group:
            first.append(base)
            numbered[name] = torch.arange(base, base + math.prod(shapes[name]), dtype=torch.int64).reshape(shapes[name])
            base += math.prod(shapes[name])
        first.append(base)  # one past the last number
        try:
            reverted = revert_weight_conversion(model, numbered)
        except (RuntimeError, ValueError, KeyError, IndexError):  # the conversion needs tensors of other layers
            continue  # its outputs stay unfound: refused below
        for name in set(names).intersection(reverted):
            found[name] = _read_back(name, reverted[name], group, first, shapes)
    for name in sorted(set(names) - set(found)):  # the first in name order: the same message every run
        raise CheckpointError(
            f"transformers' save conversion computes {name} (combines elements: neither a slice of one saved "
            "tensor, slices joined side by side, nor a reordering of one); ckptflow cannot stream it: load the "
            "model and save_pretrained it instead (see docs/hub_layout.md)")
    return found


def _by_layer(names: list[str]) -> list[list[str]]:
    """`names` grouped by the part before their last number (`...layers.3.`): one module's tensors together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = re.match(r"(.*\.\d+\.)", name)
        groups.setdefault(layer.group(1) if layer else "", []).append(name)
    return list(groups.values())


def _read_back(name: str, values, group: list[str], first: list[int], shapes: dict) -> HubSlice | HubParts:
    """Where output `name` (its elements' numbers, `values`) comes from: boxes of the numbered tensors `group`
    (tensor i numbered from `first[i]`, `first[-1]` one past the last number) side by side along one dim, each
    permuted along at most one dim."""
    import torch

    which = torch.bucketize(values, torch.tensor(first), right=True) - 1  # the saved tensor of each element
    if bool(((which < 0) | (which >= len(group))).any()):  # elements that are none of the saved ones
        raise _refused_reorder(name)
    along = next((d for d in range(values.dim()) if _only_along(which, d)), None)
    if along is None:
        raise _refused_reorder(name)
    line = _line(which, along).tolist()
    cuts = [0] + [i for i in range(1, len(line)) if line[i] != line[i - 1]] + [len(line)]
    parts, offsets = [], []
    for low, high in zip(cuts, cuts[1:]):
        source = group[line[low]]
        part = _permuted_box(name, values.narrow(along, low, high - low) - first[line[low]], source, shapes[source])
        parts.append(part)
        offsets.append(tuple(low if d == along else 0 for d in range(values.dim())))
    return parts[0] if len(parts) == 1 else HubParts(tuple(parts), tuple(offsets), tuple(values.shape))


def _permuted_box(name: str, flat, source: str, shape: tuple[int, ...]) -> HubSlice:
    """The HubSlice of `source` whose elements (flat indices `flat`, in the output's shape) the output holds."""
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    coords = [(flat // stride) % size for stride, size in zip(strides, shape)]
    start = [int(c.min()) for c in coords]
    stop = [s + 1 for s in start]
    dims, reorder = [], None
    for j, size in enumerate(flat.shape):
        if size == 1:
            dims.append(None)
            continue
        d = next((d for d in range(len(shape)) if d not in dims and _only_along(coords[d], j)), None)
        if d is None:
            raise _refused_reorder(name)
        line = _line(coords[d], j).tolist()
        start[d], stop[d] = min(line), min(line) + size
        if sorted(line) != list(range(start[d], stop[d])):
            raise _refused_reorder(name)
        if line != sorted(line):
            if reorder is not None:
                raise _refused_reorder(name)
            reorder = (j, tuple(i - start[d] for i in line))
        dims.append(d)
    if any(not _only_along(c, None) for d, c in enumerate(coords) if d not in dims):
        raise _refused_reorder(name)
    return HubSlice(source, tuple(start), tuple(stop), tuple(dims), reorder)


def _line(tensor, dim: int):
    """`tensor` along `dim`, at index 0 of every other dim."""
    return tensor[tuple(slice(None) if d == dim else 0 for d in range(tensor.dim()))]


def _only_along(tensor, dim: int | None) -> bool:
    """Whether `tensor` changes only along `dim` (None: nowhere)."""
    if dim is None:
        return bool((tensor == tensor.reshape(-1)[0]).all())
    shape = [-1 if d == dim else 1 for d in range(tensor.dim())]
    return bool((tensor == _line(tensor, dim).reshape(shape)).all())


def _refused_reorder(name: str) -> CheckpointError:
    return CheckpointError(
        f"transformers' save conversion moves the elements of {name} in a way ckptflow does not stream (not a "
        "permutation along one dim of a box of one saved tensor): load the model and save_pretrained it instead "
        "(see docs/hub_layout.md)")


def _volumes(hubs, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """How many elements of each saved tensor the outputs `hubs` read."""
    volume = {name: 0 for name in shapes}
    for hub in hubs:
        for s in hub.parts if isinstance(hub, HubParts) else (hub,):
            volume[s.source] += math.prod(b - a for a, b in zip(s.start, s.stop))
    return volume


def _check_coverage(slices: dict[str, HubSlice | HubParts], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every saved element lands in exactly one output, so the round-trip check covers all of them."""
    volume = _volumes(slices.values(), shapes)
    for name, shape in shapes.items():
        total = math.prod(shape)
        if volume[name] != total:
            raise CheckpointError(
                f"transformers' save conversion writes {volume[name]} of the {total} elements of {name}; "
                "ckptflow would lose or duplicate weights: please report this"
            )


# ---- the view: a checkpoint under the Hub's names


def hub_view(source):
    """`source` under the names `save_pretrained` writes: unchanged when they already are the Hub's (no import of
    transformers then), or when no config.json says which model this is.

    Applied last, on the names a merge would otherwise write (a LoRA checkpoint's fused names, say), by
    `mergecore.engine.merge.merge_view`.
    """
    if isinstance(source, HubLayoutSource) or source.format_name != "verl-fsdp":
        return source
    infos = source.tensors()
    if not needs_transformers(infos):
        return source
    config_file = source.hf_dir.join("config.json") if source.hf_dir else None
    if config_file is None or not config_file.exists():
        return source  # nothing says which model this is: keep the saved names
    slices = hub_slices(read_hf_config(source), {name: info.shape for name, info in infos.items()})
    return source if slices is None else HubLayoutSource(source, slices)


class HubLayoutSource(CheckpointSource):
    """A checkpoint in transformers' in-memory layout seen in the Hub's: each output tensor one `HubSlice` of
    one inner tensor, read from the part of each rank's piece it needs (bounded memory)."""

    def __init__(self, inner, slices: dict[str, HubSlice]):
        self.inner = inner
        self.slices = slices
        self.format_name = inner.format_name
        self.backend = inner.backend
        self.location = inner.location
        self.hf_dir = inner.hf_dir
        self.step = getattr(inner, "step", None)

    @property
    def identity(self):
        return getattr(self.inner, "identity", None)

    def _whole(self, name: str) -> bool:
        hub = self.slices[name]
        return isinstance(hub, HubSlice) and hub.is_whole(self.inner.tensors()[hub.source].shape)

    def tensors(self):
        inner = self.inner.tensors()
        return {name: TensorInfo(name, s.shape, inner[_first_source(s)].dtype, inner[_first_source(s)].layout)
                for name, s in self.slices.items()}

    def pieces(self, name: str):
        hub = self.slices[name]
        if isinstance(hub, HubParts):
            return self._joined_pieces(hub)
        return (found for piece in self.inner.pieces(hub.source) for found in _pieces_in_slice(piece, hub))

    def _joined_pieces(self, hub: HubParts):
        """Each part's pieces, moved to where the part sits in the output: a row block reads each part's rows."""
        for part, at in zip(hub.parts, hub.offsets):
            for piece in self.inner.pieces(part.source):
                for found in _pieces_in_slice(piece, part):
                    yield replace(found, offsets=tuple(o + a for o, a in zip(found.offsets, at)))

    def validate(self, check_replicas: bool = False) -> None:
        self.inner.validate(check_replicas)
        adapted = getattr(self.inner, "adapted", None)  # a fused LoRA view computes its values: not sliceable
        inner = self.inner.tensors()
        for name, hub in self.slices.items():
            for source in sources_of(hub):
                if adapted and adapted(source) and not self._whole(name):
                    raise CheckpointError(
                        f"{self.location}: the LoRA adapter of {source} adapts a tensor the Hub layout splits or "
                        f"joins into {name}; fusing it is not supported: pass --lora adapter"
                    )
            dtypes = {inner[source].dtype for source in sources_of(hub)}
            if len(dtypes) > 1:
                raise CheckpointError(
                    f"{self.location}: {name} joins {', '.join(sources_of(hub))}, saved in different dtypes "
                    f"({', '.join(sorted(dtypes))}); save_pretrained would promote them: load the model and "
                    "save_pretrained it instead"
                )

    def read(self, name: str, dtype: str | None = None):
        if self._whole(name):
            return self.inner.read(self.slices[name].source, dtype)  # a rename: the inner view's own values
        return super().read(name, dtype)

    def streams(self, name: str) -> bool:
        if self._whole(name):
            return self.inner.streams(self.slices[name].source)
        return bool(self.slices[name].shape)

    def check_round_trip(self, name: str, merged) -> int:
        if self._whole(name):
            return self.inner.check_round_trip(self.slices[name].source, merged)
        return super().check_round_trip(name, merged)

    def _saved_names(self, names) -> list[str]:
        return [source for n in names for source in (sources_of(self.slices[n]) if n in self.slices else (n,))]

    def prefetch(self, names) -> None:
        self.inner.prefetch(self._saved_names(names))

    def input_files(self, names=None) -> list:
        return self.inner.input_files(None if names is None else self._saved_names(names))

    def describe(self) -> dict:
        return self.inner.describe()


def _pieces_in_slice(piece, hub: HubSlice):
    """The part of a saved piece inside an output's slice, in the output's coordinates (a view); where the slice
    is permuted along a dim, one piece per run of consecutive output indices the saved piece holds (a copy)."""
    low = [max(o, a) for o, a in zip(piece.offsets, hub.start)]
    high = [min(o + s, b) for o, s, b in zip(piece.offsets, piece.sizes, hub.stop)]
    if any(h <= lo for lo, h in zip(low, high)):
        return
    local = to_numpy(piece.tensor)[tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, piece.offsets))]
    offsets = tuple(0 if d is None else low[d] - hub.start[d] for d in hub.dims)
    sizes = tuple(1 if d is None else high[d] - low[d] for d in hub.dims)
    used = [d for d in hub.dims if d is not None]
    along = sorted(used)  # the box's own dims in source order (the others have size 1)
    moved = local.reshape([high[d] - low[d] for d in along]).transpose([along.index(d) for d in used])
    found = Piece(piece.source, offsets, sizes, moved.reshape(sizes), piece.primary)
    if hub.reorder is None:
        yield found
        return
    j, order = hub.reorder
    order, first, count = np.asarray(order), offsets[j], sizes[j]
    held = np.flatnonzero((order >= first) & (order < first + count))  # the output indices this piece fills
    for run in np.split(held, np.flatnonzero(np.diff(held) != 1) + 1):
        yield replace(found, offsets=offsets[:j] + (int(run[0]),) + offsets[j + 1:],
                      sizes=sizes[:j] + (len(run),) + sizes[j + 1:],
                      tensor=np.take(found.tensor, order[run] - first, axis=j))
