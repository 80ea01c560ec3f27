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

    def check_round_trip(self, name: str, merged) -> int:
        """Re-split `merged` (the output tensor holding `name`) as training saved it and compare every
        saved piece bit for bit, cast to the output dtype. Returns the number of pieces compared.

        Formats whose pieces are not plain boxes of the global tensor (Megatron's fused QKV, say)
        override this with their inverse transforms.
        """
        from ..arrays import bitwise_equal, cast, dtype_of, to_numpy
        from ..errors import VerificationError

        merged = to_numpy(merged)
        count = 0
        for piece in self.pieces(name):
            if not bitwise_equal(merged[piece.index], cast(piece.tensor, dtype_of(merged))):
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
        import numpy as np

        from ..arrays import cast_into, numpy_dtype

        info = self.tensors()[name]
        out = np.empty(info.shape, dtype=numpy_dtype(dtype or info.dtype))
        for piece in self.pieces(name):
            if piece.primary:
                cast_into(out[piece.index], piece.tensor)
        return out


def read_hf_config(source: CheckpointSource) -> dict:
    """config.json from the checkpoint's `huggingface/` folder (or the folder given instead)."""
    from ..errors import CheckpointError
    from ..tensorio import read_json

    config_file = source.hf_dir.join("config.json") if source.hf_dir else None
    if config_file is None or not config_file.exists():
        raise CheckpointError(
            f"{config_file or source.location}: no config.json; the checkpoint lacks its huggingface/ folder: "
            "pass --hf_model_path pointing at the base model's folder"
        )
    return read_json(config_file, fix="restore it from the base model")
