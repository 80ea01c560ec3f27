"""How one tensor-parallel tensor maps to Hugging Face tensors, in both directions.

A transform knows how training split (and maybe fused) a tensor over `tp` ranks:

- `merge(pieces)` -> `{part: global tensor}`: the per-rank pieces as training saved them, merged;
- `split(parts, tp)` -> per-rank pieces: the exact inverse, used to re-shard and to verify.

`parts` names the Hugging Face tensors one saved tensor holds: `("",)` for a plain tensor,
`("q", "k", "v")` for Megatron's fused QKV, `("gate", "up")` for a fused SwiGLU input.
`merge(split(x, tp)) == x` and `split(merge(p), tp) == p` hold bit for bit (for `VocabParallel`,
`split` pads with zeros: pieces round-trip when their padding rows are zero).

The reader works one part and one rank at a time to keep memory at one output tensor:
`extract(piece, part)` is a rank's slice of one part, `combine(slices, part)` joins the ranks,
`scatter(tensor, tp, part)` undoes `combine` and `fuse({part: slice})` undoes `extract`.
"""

from __future__ import annotations

import torch

__all__ = [
    "Transform", "ColumnParallel", "RowParallel", "Replicated", "VocabParallel", "FusedQKV", "GatedMLP",
    "ReplicatedGatedMLP", "pad_vocab", "make_transform",
]


def _equal_chunks(tensor: torch.Tensor, tp: int, dim: int, what: str) -> list[torch.Tensor]:
    if tensor.shape[dim] % tp:
        raise ValueError(f"{what}: size {tensor.shape[dim]} on dim {dim} is not divisible by tensor parallel size {tp}")
    return list(torch.chunk(tensor, tp, dim=dim)) if tp > 1 else [tensor]


class Transform:
    """Base class: a tensor concatenated over TP ranks along `dim`, with one part."""

    parts: tuple[str, ...] = ("",)
    dim = 0
    kind = "column"
    replicated = False  # every rank holds the whole tensor: merging reads rank 0, the others are checked

    # ---- one part, one rank at a time (what the reader uses) ----------------------------------
    def extract(self, piece: torch.Tensor, part: str = "") -> torch.Tensor:
        """This rank's slice of `part`."""
        return piece

    def extract_views(self, piece: torch.Tensor, part: str = "") -> list[torch.Tensor]:
        """`extract(piece, part)` as views of `piece` whose concatenation along dim 0 it is: reading rows of
        the merged tensor then touches only those rows (no copy of a rank's whole part)."""
        return [self.extract(piece, part)]

    def combine(self, slices: list[torch.Tensor], part: str = "") -> torch.Tensor:
        """Every rank's slice of `part`, joined into the global tensor."""
        return torch.cat(slices, dim=self.dim) if len(slices) > 1 else slices[0]

    def scatter(self, tensor: torch.Tensor, tp: int, part: str = "") -> list[torch.Tensor]:
        """Inverse of `combine`: the global `part` cut into per-rank slices."""
        return _equal_chunks(tensor, tp, self.dim, type(self).__name__)

    def fuse(self, slices: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `extract` over every part: one rank's saved piece."""
        return slices[self.parts[0]]

    def trim(self, piece_slice: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """The part of a rank's slice that reaches the merged tensor (all of it, except vocab padding)."""
        return piece_slice

    def local_shape(self, shapes: dict[str, tuple[int, ...]], tp: int) -> tuple[int, ...]:
        """Shape of one rank's saved piece, given the global shape of every part."""
        shape = list(shapes[self.parts[0]])
        shape[self.dim] //= tp
        return tuple(shape)

    def global_shape(self, piece_shape: tuple[int, ...], tp: int, part: str = "") -> tuple[int, ...]:
        """Shape of the merged `part`, given one rank's piece shape."""
        shape = list(piece_shape)
        shape[self.dim] *= tp
        return tuple(shape)

    # ---- whole tensors (fixtures, tests, small tensors) ----------------------------------------
    def merge(self, pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {part: self.combine([self.extract(p, part) for p in pieces], part) for part in self.parts}

    def split(self, tensors: dict[str, torch.Tensor] | torch.Tensor, tp: int) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor):
            tensors = {self.parts[0]: tensors}
        scattered = {part: self.scatter(tensors[part], tp, part) for part in self.parts}
        return [self.fuse({part: scattered[part][rank] for part in self.parts}) for rank in range(tp)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ColumnParallel(Transform):
    """Output features split over ranks (dim 0): `linear_fc1` without gating, QKV-less projections.

    >>> t = ColumnParallel(); w = torch.arange(8.).reshape(4, 2)
    >>> [p.shape[0] for p in t.split(w, 2)], torch.equal(t.merge(t.split(w, 2))[""], w)
    ([2, 2], True)
    """

    dim = 0
    kind = "column"


class RowParallel(Transform):
    """Input features split over ranks (dim 1): `linear_proj`, `linear_fc2`.

    >>> t = RowParallel(); w = torch.arange(8.).reshape(2, 4)
    >>> [p.shape for p in t.split(w, 2)]
    [torch.Size([2, 2]), torch.Size([2, 2])]
    """

    dim = 1
    kind = "row"


class Replicated(Transform):
    """Every rank holds the whole tensor (norms, router, value head); merging takes rank 0's copy.

    >>> t = Replicated(); n = torch.ones(3)
    >>> len(t.split(n, 4)), torch.equal(t.merge(t.split(n, 4))[""], n)
    (4, True)
    """

    kind = "replicated"
    replicated = True

    def combine(self, slices, part=""):
        return slices[0]

    def scatter(self, tensor, tp, part=""):
        return [tensor] * tp

    def local_shape(self, shapes, tp):
        return tuple(shapes[self.parts[0]])

    def global_shape(self, piece_shape, tp, part=""):
        return tuple(piece_shape)


def pad_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of `divisible_by * tp`.

    >>> pad_vocab(300, 2)
    512
    """
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


class VocabParallel(Transform):
    """Embedding / output rows split over ranks after padding the vocabulary; merging trims the padding.

    >>> t = VocabParallel(5); e = torch.arange(10.).reshape(5, 2)
    >>> [p.shape[0] for p in t.split(e, 2)]   # padded to 256 rows (128 * tp)
    [128, 128]
    >>> torch.equal(t.merge(t.split(e, 2))[""], e)
    True
    """

    kind = "vocab"

    def __init__(self, vocab_size: int, padded_size: int | None = None, divisible_by: int = 128):
        self.vocab_size = vocab_size
        self.padded_size = padded_size
        self.divisible_by = divisible_by

    def combine(self, slices, part=""):
        merged = torch.cat(slices, dim=0) if len(slices) > 1 else slices[0]
        if merged.shape[0] < self.vocab_size:
            raise ValueError(f"{merged.shape[0]} rows are fewer than vocab_size {self.vocab_size}")
        return merged[: self.vocab_size]

    def scatter(self, tensor, tp, part=""):
        padded = self.padded_size or pad_vocab(tensor.shape[0], tp, self.divisible_by)
        if padded > tensor.shape[0]:
            pad = tensor.new_zeros((padded - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad], dim=0)
        return _equal_chunks(tensor, tp, 0, "VocabParallel")

    def trim(self, piece_slice, rank, tp):
        rows = piece_slice.shape[0]
        return piece_slice[: max(0, min(rows, self.vocab_size - rank * rows))]

    def local_shape(self, shapes, tp):
        shape = list(shapes[""])
        shape[0] = (self.padded_size or pad_vocab(shape[0], tp, self.divisible_by)) // tp
        return tuple(shape)

    def global_shape(self, piece_shape, tp, part=""):
        return (self.vocab_size, *piece_shape[1:])

    def __repr__(self) -> str:
        return f"VocabParallel({self.vocab_size})"


class FusedQKV(Transform):
    """Megatron's `linear_qkv`: per query group `[q heads of the group, k, v]` (head_dim rows each), groups
    in order; TP splits by whole groups. Weights and biases alike.

    >>> t = FusedQKV(num_heads=4, num_kv_heads=2, head_dim=1)
    >>> parts = {"q": torch.tensor([0., 1, 2, 3]), "k": torch.tensor([10., 11]), "v": torch.tensor([20., 21])}
    >>> [p.tolist() for p in t.split(parts, 2)]
    [[0.0, 1.0, 10.0, 20.0], [2.0, 3.0, 11.0, 21.0]]
    >>> t.merge(t.split(parts, 2))["k"].tolist()
    [10.0, 11.0]
    """

    parts = ("q", "k", "v")
    kind = "qkv"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_per_group = num_heads // num_kv_heads

    @property
    def group_rows(self) -> int:
        return (self.q_per_group + 2) * self.head_dim

    def _rows(self, part: str) -> tuple[int, int]:
        q = self.q_per_group * self.head_dim
        return {"q": (0, q), "k": (q, q + self.head_dim), "v": (q + self.head_dim, q + 2 * self.head_dim)}[part]

    def extract(self, piece, part="q"):
        if piece.shape[0] % self.group_rows:
            raise ValueError(f"{piece.shape[0]} rows are not whole query groups of {self.group_rows} rows")
        groups = piece.shape[0] // self.group_rows
        begin, end = self._rows(part)
        return piece.reshape(groups, self.group_rows, *piece.shape[1:])[:, begin:end].reshape(-1, *piece.shape[1:])

    def extract_views(self, piece, part="q"):
        if piece.shape[0] % self.group_rows:
            raise ValueError(f"{piece.shape[0]} rows are not whole query groups of {self.group_rows} rows")
        begin, end = self._rows(part)
        return [piece[g + begin:g + end] for g in range(0, piece.shape[0], self.group_rows)]

    def scatter(self, tensor, tp, part="q"):
        if self.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads {self.num_kv_heads} is not divisible by tensor parallel size {tp}")
        return _equal_chunks(tensor, tp, 0, f"FusedQKV {part}")

    def fuse(self, slices):
        rest = slices["q"].shape[1:]
        groups = slices["k"].shape[0] // self.head_dim
        blocks = [slices[p].reshape(groups, -1, *rest) for p in self.parts]
        return torch.cat(blocks, dim=1).reshape(-1, *rest)

    def local_shape(self, shapes, tp):
        return (self.num_kv_heads // tp * self.group_rows, *shapes["q"][1:])

    def global_shape(self, piece_shape, tp, part="q"):
        heads = self.num_heads if part == "q" else self.num_kv_heads
        return (heads * self.head_dim, *piece_shape[1:])

    def __repr__(self) -> str:
        return f"FusedQKV({self.num_heads}, {self.num_kv_heads}, {self.head_dim})"


class GatedMLP(Transform):
    """SwiGLU `linear_fc1`: each rank holds `[gate_r; up_r]`, column-parallel.

    >>> t = GatedMLP(); parts = {"gate": torch.tensor([0., 1]), "up": torch.tensor([2., 3])}
    >>> [p.tolist() for p in t.split(parts, 2)]
    [[0.0, 2.0], [1.0, 3.0]]
    """

    parts = ("gate", "up")
    kind = "gated"

    def extract(self, piece, part="gate"):
        if piece.shape[0] % 2:
            raise ValueError(f"{piece.shape[0]} rows cannot hold [gate; up] halves")
        half = piece.shape[0] // 2
        return piece[:half] if part == "gate" else piece[half:]

    def fuse(self, slices):
        return torch.cat([slices["gate"], slices["up"]], dim=0)

    def local_shape(self, shapes, tp):
        return (2 * shapes["gate"][0] // tp, *shapes["gate"][1:])

    def global_shape(self, piece_shape, tp, part="gate"):
        return (piece_shape[0] // 2 * tp, *piece_shape[1:])


class ReplicatedGatedMLP(GatedMLP):
    """`[gate; up]` held whole by every rank: MoE experts trained with expert_tensor_parallel_size=1 under TP > 1.

    >>> t = ReplicatedGatedMLP(); parts = {"gate": torch.tensor([0., 1]), "up": torch.tensor([2., 3])}
    >>> [p.tolist() for p in t.split(parts, 2)]
    [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
    """

    replicated = True

    def combine(self, slices, part="gate"):
        return slices[0]

    def scatter(self, tensor, tp, part="gate"):
        return [tensor] * tp

    def local_shape(self, shapes, tp):
        return (2 * shapes["gate"][0], *shapes["gate"][1:])

    def global_shape(self, piece_shape, tp, part="gate"):
        return (piece_shape[0] // 2, *piece_shape[1:])


def make_transform(kind: str, config: dict) -> Transform:
    """The transform a mapping table's `kind` names, sized from a Hugging Face config."""
    if kind == "column":
        return ColumnParallel()
    if kind == "row":
        return RowParallel()
    if kind == "replicated":
        return Replicated()
    if kind == "gated":
        return GatedMLP()
    if kind == "vocab":
        return VocabParallel(int(config["vocab_size"]))
    if kind == "qkv":
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        return FusedQKV(heads, kv, head_dim)
    raise ValueError(f"unknown transform kind {kind!r} (column, row, replicated, gated, vocab, qkv)")


KINDS = ("column", "row", "replicated", "gated", "vocab", "qkv")
