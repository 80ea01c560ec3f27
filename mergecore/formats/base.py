"""The seam every checkpoint format implements: discover -> describe tensors -> read slices.

A format module turns "a folder of training pieces" into global tensors under Hugging Face names.
Everything downstream (planning, writing, verification, the pipeline) only sees this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..storage import Location


@dataclass(frozen=True)
class TensorInfo:
    """A global tensor as training saved it: HF name, global shape, source dtype, how it was split."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Piece:
    """One rank's slice of a global tensor: where it sits (offsets/sizes) and its values
    (a numpy array; readers that work in torch may give a torch tensor)."""

    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: object
    primary: bool = True  # False for replicas (HSDP): only checked, never needed to merge

    @property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


class CheckpointSource(ABC):
    """A discovered checkpoint. Subclasses: one per format (FSDP, Megatron legacy, dist_ckpt)."""

    format_name: str
    backend: str = ""  # the FORMATS key it was opened as, set by open_checkpoint; recorded to reopen it alike
    location: Location
    hf_dir: Location | None

    @abstractmethod
    def describe(self) -> dict:
        """Plain facts for reports and the manifest: format, step, role, world size, mesh..."""

    @abstractmethod
    def tensors(self) -> dict[str, TensorInfo]:
        """Every global tensor, in the order training saved them."""

    @abstractmethod
    def validate(self, check_replicas: bool = False) -> None:
        """Raise CheckpointError on anything inconsistent, before any output is written."""

    @abstractmethod
    def pieces(self, name: str) -> Iterator[Piece]:
        """Every saved slice of `name`, replicas included (they are checked, not merged)."""

    @abstractmethod
    def input_files(self, names: Iterable[str] | None = None) -> list[Location]:
        """The files that hold `names` (all tensors when None); cache keys use their fingerprints."""

    def prefetch(self, names: Iterable[str]) -> None:
        """A hint that `names` are read next, together (one output file): a source reading remote files may
        fetch their bytes in one batch, and only theirs. Without it, reads come a layer group at a time.

        >>> source.prefetch(["model.embed_tokens.weight"])  # doctest: +SKIP
        """

    def check_round_trip(self, name: str, merged) -> int:
        """Re-split `merged` (the output tensor holding `name`) as training saved it and compare every
        saved piece bit for bit, cast to the output dtype. Returns the number of pieces compared.

        Each piece is compared in row blocks of `budget.chunk_bytes()`, so no temporary holds a whole piece.
        Formats whose pieces are not plain boxes of the global tensor (Megatron's fused QKV, say)
        override this with their inverse transforms.
        """
        from ..numbers.arrays import bitwise_equal, cast, dtype_of, to_numpy
        from ..numbers.budget import chunk_bytes, row_spans
        from ..errors import VerificationError

        merged, budget = to_numpy(merged), chunk_bytes()
        count = 0
        for piece in self.pieces(name):
            saved, index = to_numpy(piece.tensor), piece.index
            for low, high in row_spans(saved.shape, merged.dtype.itemsize, budget):
                mine = merged[(slice(index[0].start + low, index[0].start + high), *index[1:])] if saved.ndim else merged
                if not bitwise_equal(mine, cast(saved[low:high] if saved.ndim else saved, dtype_of(merged))):
                    raise VerificationError(
                        f"{piece.source}: tensor {name} at offsets {piece.offsets} differs from the merged output; "
                        "the merge is wrong: do not publish it (please report this)"
                    )
            count += 1
        return count

    def read(self, name: str, dtype: str | None = None):
        """The global tensor `name` as a numpy array, assembled from its primary pieces and cast to
        `dtype` (a name such as "bfloat16"; None keeps the saved dtype).

        Only this tensor's bytes are touched: pieces are views into mmapped files.
        """
        info = self.tensors()[name]
        return self.read_rows(name, 0, info.shape[0] if info.shape else 1, dtype)

    def read_rows(self, name: str, start: int, stop: int, dtype: str | None = None):
        """Rows [start, stop) (along dim 0) of the global tensor `name`, from the parts of its primary
        pieces that overlap them, cast to `dtype`: memory is the rows asked for, whatever the tensor's size.
        A 0-d tensor has one row (itself).

        >>> source.read_rows("model.embed_tokens.weight", 0, 1024, "bfloat16").shape   # doctest: +SKIP
        (1024, 2048)
        """
        import numpy as np

        from ..numbers.arrays import cast, cast_into, numpy_dtype, to_numpy

        info = self.tensors()[name]
        target = dtype or info.dtype
        if not info.shape:
            out = np.empty((), dtype=numpy_dtype(target))
            for piece in self.pieces(name):
                if piece.primary:
                    out[()] = cast(to_numpy(piece.tensor), target)
            return out
        out = np.empty((stop - start, *info.shape[1:]), dtype=numpy_dtype(target))
        for piece in self.pieces(name):
            first, count = piece.offsets[0], piece.sizes[0]
            low, high = max(start, first), min(stop, first + count)
            if not piece.primary or low >= high:
                continue
            rows = to_numpy(piece.tensor)[low - first:high - first]
            cast_into(out[(slice(low - start, high - start), *piece.index[1:])], rows)
        return out

    def streams(self, name: str) -> bool:
        """Whether `read_rows` gives the rows of `read` (values that are the pieces' own), so a writer may
        ask for row blocks. A source whose `read` computes its values otherwise (fused LoRA, Megatron's
        transforms) streams only where it says so by overriding this."""
        return type(self).read is CheckpointSource.read and bool(self.tensors()[name].shape)

    def row_blocks(self, name: str, dtype: str | None = None, budget: int | None = None) -> Iterator[tuple[int, object]]:
        """`(first row, block)` pairs covering `name` in order, each block at most about `budget` bytes with
        its temporaries (`budget.rows_per_block`); one whole-tensor block when the source does not stream
        `name` or `budget` is 0/None (unbounded).

        >>> [start for start, _ in source.row_blocks("lm_head.weight", "bfloat16", 64 << 20)]  # doctest: +SKIP
        [0, 8192, 16384]
        """
        from ..numbers.arrays import element_size
        from ..numbers.budget import row_spans

        info = self.tensors()[name]
        spans = list(row_spans(info.shape, element_size(dtype or info.dtype), budget)) if self.streams(name) else []
        if len(spans) <= 1:
            yield 0, self.read(name, dtype)
            return
        for low, high in spans:
            yield low, self.read_rows(name, low, high, dtype)


def read_hf_config(source: CheckpointSource) -> dict:
    """config.json from the checkpoint's `huggingface/` folder (or the folder given instead)."""
    from ..errors import CheckpointError
    from ..storage.tensorio import read_json

    config_file = source.hf_dir.join("config.json") if source.hf_dir else None
    if config_file is None or not config_file.exists():
        raise CheckpointError(
            f"{config_file or source.location}: no config.json; the checkpoint lacks its huggingface/ folder: "
            "pass --hf_model_path pointing at the base model's folder"
        )
    return read_json(config_file, fix="restore it from the base model")
