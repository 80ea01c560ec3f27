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
`row_map(rows, part)` says, at TP=1 (dist_ckpt's and DCP's global tensors), which saved rows land where in
`part`, so a reader can place a part straight from the saved rows without building it (`rows_placed` cuts a
saved box of rows along those runs).

Values are numpy arrays (bfloat16 as its uint16 bits, see `mergecore.numbers.arrays`): a merge never imports
torch. Torch tensors work as well (the test fixtures cut real models with `split`); torch is then
imported only to concatenate them.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "Transform", "ColumnParallel", "RowParallel", "Replicated", "VocabParallel", "FusedQKV", "GatedMLP",
    "ReplicatedGatedMLP", "InterleavedRope", "pad_vocab", "make_transform", "rows_placed",
]


def _equal_chunks(tensor, tp: int, dim: int, what: str) -> list:
    """`tensor` cut into `tp` equal views along `dim`."""
    if tensor.shape[dim] % tp:
        raise ValueError(f"{what}: size {tensor.shape[dim]} on dim {dim} is not divisible by tensor parallel size {tp}")
    size = tensor.shape[dim] // tp
    lead = (slice(None),) * dim
    return [tensor[(*lead, slice(r * size, (r + 1) * size))] for r in range(tp)] if tp > 1 else [tensor]


def _cat(arrays: list, dim: int):
    """Concatenate numpy arrays (or torch tensors, for callers that hold them) along `dim`."""
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=dim)
    import torch

    return torch.cat(list(arrays), dim=dim)


def _zero_rows(like, rows: int):
    """`rows` zero rows shaped and typed like the rows of `like` (zero bits are 0.0 in every float dtype)."""
    if isinstance(like, np.ndarray):
        return np.zeros((rows, *like.shape[1:]), like.dtype)
    return like.new_zeros((rows, *like.shape[1:]))


class Transform:
    """Base class: a tensor concatenated over TP ranks along `dim`, with one part."""

    parts: tuple[str, ...] = ("",)
    dim = 0
    kind = "column"
    replicated = False  # every rank holds the whole tensor: merging reads rank 0, the others are checked

    # ---- one part, one rank at a time (what the reader uses) ----------------------------------
    def extract(self, piece: np.ndarray, part: str = "") -> np.ndarray:
        """This rank's slice of `part`."""
        return piece

    def extract_views(self, piece: np.ndarray, part: str = "") -> list[np.ndarray]:
        """`extract(piece, part)` as views of `piece` whose concatenation along dim 0 it is: reading rows of
        the merged tensor then touches only those rows (no copy of a rank's whole part)."""
        return [self.extract(piece, part)]

    def combine(self, slices: list[np.ndarray], part: str = "") -> np.ndarray:
        """Every rank's slice of `part`, joined into the global tensor."""
        return _cat(slices, self.dim) if len(slices) > 1 else slices[0]

    def scatter(self, tensor: np.ndarray, tp: int, part: str = "") -> list[np.ndarray]:
        """Inverse of `combine`: the global `part` cut into per-rank slices."""
        return _equal_chunks(tensor, tp, self.dim, type(self).__name__)

    def fuse(self, slices: dict[str, np.ndarray]) -> np.ndarray:
        """Inverse of `extract` over every part: one rank's saved piece."""
        return slices[self.parts[0]]

    def trim(self, piece_slice: np.ndarray, rank: int, tp: int) -> np.ndarray:
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

    def row_map(self, rows: int, part: str = "") -> list[tuple[int, ...]]:
        """At TP=1, where the rows of a saved tensor of `rows` rows go: `(start, stop, first row in part)`
        for each run of saved rows `[start, stop)` that lands, in order, in `part` (what `extract` and
        `trim` keep); a fourth number, when there, is the run's step (every other saved row, say). A reader
        places `part` from these runs without building it (`rows_placed`).

        >>> FusedQKV(4, 2, 1).row_map(8, "k")   # groups [q q k v] [q q k v]
        [(2, 3, 0), (6, 7, 1)]
        """
        return [(0, rows, 0)]

    # ---- whole tensors (fixtures, tests, small tensors) ----------------------------------------
    def merge(self, pieces: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {part: self.combine([self.extract(p, part) for p in pieces], part) for part in self.parts}

    def split(self, tensors: dict[str, np.ndarray] | np.ndarray, tp: int) -> list[np.ndarray]:
        if not isinstance(tensors, dict):
            tensors = {self.parts[0]: tensors}
        scattered = {part: self.scatter(tensors[part], tp, part) for part in self.parts}
        return [self.fuse({part: scattered[part][rank] for part in self.parts}) for rank in range(tp)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ColumnParallel(Transform):
    """Output features split over ranks (dim 0): `linear_fc1` without gating, QKV-less projections.

    >>> t = ColumnParallel(); w = np.arange(8.).reshape(4, 2)
    >>> [p.shape[0] for p in t.split(w, 2)], np.array_equal(t.merge(t.split(w, 2))[""], w)
    ([2, 2], True)
    """

    dim = 0
    kind = "column"


class RowParallel(Transform):
    """Input features split over ranks (dim 1): `linear_proj`, `linear_fc2`.

    >>> t = RowParallel(); w = np.arange(8.).reshape(2, 4)
    >>> [p.shape for p in t.split(w, 2)]
    [(2, 2), (2, 2)]
    """

    dim = 1
    kind = "row"


class Replicated(Transform):
    """Every rank holds the whole tensor (norms, router, value head); merging takes rank 0's copy.

    >>> t = Replicated(); n = np.ones(3)
    >>> len(t.split(n, 4)), np.array_equal(t.merge(t.split(n, 4))[""], n)
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

    >>> t = VocabParallel(5); e = np.arange(10.).reshape(5, 2)
    >>> [p.shape[0] for p in t.split(e, 2)]   # padded to 256 rows (128 * tp)
    [128, 128]
    >>> np.array_equal(t.merge(t.split(e, 2))[""], e)
    True
    """

    kind = "vocab"

    def __init__(self, vocab_size: int, padded_size: int | None = None, divisible_by: int = 128):
        self.vocab_size = vocab_size
        self.padded_size = padded_size
        self.divisible_by = divisible_by

    def combine(self, slices, part=""):
        merged = _cat(slices, 0) if len(slices) > 1 else slices[0]
        if merged.shape[0] < self.vocab_size:
            raise ValueError(f"{merged.shape[0]} rows are fewer than vocab_size {self.vocab_size}")
        return merged[: self.vocab_size]

    def scatter(self, tensor, tp, part=""):
        padded = self.padded_size or pad_vocab(tensor.shape[0], tp, self.divisible_by)
        if padded > tensor.shape[0]:
            tensor = _cat([tensor, _zero_rows(tensor, padded - tensor.shape[0])], 0)
        return _equal_chunks(tensor, tp, 0, "VocabParallel")

    def trim(self, piece_slice, rank, tp):
        rows = piece_slice.shape[0]
        return piece_slice[: max(0, min(rows, self.vocab_size - rank * rows))]

    def row_map(self, rows, part=""):
        return [(0, min(rows, self.vocab_size), 0)]

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
    >>> parts = {"q": np.array([0., 1, 2, 3]), "k": np.array([10., 11]), "v": np.array([20., 21])}
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

    def row_map(self, rows, part="q"):
        if rows % self.group_rows:
            raise ValueError(f"{rows} rows are not whole query groups of {self.group_rows} rows")
        begin, end = self._rows(part)
        return [(g * self.group_rows + begin, g * self.group_rows + end, g * (end - begin))
                for g in range(rows // self.group_rows)]

    def scatter(self, tensor, tp, part="q"):
        if self.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads {self.num_kv_heads} is not divisible by tensor parallel size {tp}")
        return _equal_chunks(tensor, tp, 0, f"FusedQKV {part}")

    def fuse(self, slices):
        rest = slices["q"].shape[1:]
        groups = slices["k"].shape[0] // self.head_dim
        blocks = [slices[p].reshape(groups, -1, *rest) for p in self.parts]
        return _cat(blocks, 1).reshape(-1, *rest)

    def local_shape(self, shapes, tp):
        return (self.num_kv_heads // tp * self.group_rows, *shapes["q"][1:])

    def global_shape(self, piece_shape, tp, part="q"):
        heads = self.num_heads if part == "q" else self.num_kv_heads
        return (heads * self.head_dim, *piece_shape[1:])

    def __repr__(self) -> str:
        return f"FusedQKV({self.num_heads}, {self.num_kv_heads}, {self.head_dim})"


class GatedMLP(Transform):
    """SwiGLU `linear_fc1`: each rank holds `[gate_r; up_r]`, column-parallel.

    >>> t = GatedMLP(); parts = {"gate": np.array([0., 1]), "up": np.array([2., 3])}
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

    def row_map(self, rows, part="gate"):
        if rows % 2:
            raise ValueError(f"{rows} rows cannot hold [gate; up] halves")
        half = rows // 2
        return [(0, half, 0)] if part == "gate" else [(half, rows, 0)]

    def fuse(self, slices):
        return _cat([slices["gate"], slices["up"]], 0)

    def local_shape(self, shapes, tp):
        return (2 * shapes["gate"][0] // tp, *shapes["gate"][1:])

    def global_shape(self, piece_shape, tp, part="gate"):
        return (piece_shape[0] // 2 * tp, *piece_shape[1:])


class ReplicatedGatedMLP(GatedMLP):
    """`[gate; up]` held whole by every rank: MoE experts trained with expert_tensor_parallel_size=1 under TP > 1.

    >>> t = ReplicatedGatedMLP(); parts = {"gate": np.array([0., 1]), "up": np.array([2., 3])}
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


class InterleavedRope(Transform):
    """q or k rows of a model whose rotary embedding pairs neighbouring features (Meta's Llama code, torchtitan's
    `ComplexRoPE`): within each head, feature pairs (2i, 2i+1); Hugging Face's Llama rotates halves (i, i + d/2).
    The Hub tensor has, per head, the even rows first, then the odd ones: a reordering of whole rows, so a
    reader places it from strided runs of saved rows, streamed like any other.

    >>> t = InterleavedRope(heads=2, head_dim=4); w = np.arange(8.)   # head 0: rows 0..3, head 1: rows 4..7
    >>> t.extract(w).tolist()
    [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    >>> t.row_map(8)
    [(0, 4, 0, 2), (1, 4, 2, 2), (4, 8, 4, 2), (5, 8, 6, 2)]
    >>> np.array_equal(t.fuse({"": t.extract(w)}), w)
    True
    """

    kind = "rope"

    def __init__(self, heads: int, head_dim: int):
        if head_dim % 2:
            raise ValueError(f"head_dim {head_dim} is odd: rotary embeddings pair features")
        self.heads, self.head_dim = heads, head_dim

    def _check(self, rows: int) -> None:
        if rows != self.heads * self.head_dim:
            raise ValueError(f"{rows} rows are not {self.heads} heads of {self.head_dim}")

    def extract(self, piece, part=""):
        self._check(piece.shape[0])
        rest = piece.shape[1:]
        heads = piece.reshape(self.heads, self.head_dim // 2, 2, *rest)
        return heads.swapaxes(1, 2).reshape(piece.shape) if isinstance(piece, np.ndarray) else \
            heads.transpose(1, 2).reshape(piece.shape)

    def extract_views(self, piece, part=""):
        return [piece[start:stop:step] for start, stop, _, step in self.row_map(piece.shape[0], part)]

    def fuse(self, slices):
        tensor = slices[""]
        rest = tensor.shape[1:]
        heads = tensor.reshape(self.heads, 2, self.head_dim // 2, *rest)
        return heads.swapaxes(1, 2).reshape(tensor.shape) if isinstance(tensor, np.ndarray) else \
            heads.transpose(1, 2).reshape(tensor.shape)

    def row_map(self, rows, part=""):
        self._check(rows)
        half = self.head_dim // 2
        return [(h * self.head_dim + odd, (h + 1) * self.head_dim, h * self.head_dim + odd * half, 2)
                for h in range(self.heads) for odd in (0, 1)]

    def __repr__(self) -> str:
        return f"InterleavedRope({self.heads}, {self.head_dim})"


def rows_placed(first: int, count: int, runs) -> list[tuple[slice, int]]:
    """Where the saved rows `[first, first + count)` (a saved box of them) land: `(rows of the box, first row in
    the part)` for each run of `row_map` the box meets; the box's rows of a run with a step are a strided slice.

    >>> rows_placed(2, 4, [(0, 8, 0, 2), (1, 8, 4, 2)])   # rows 2..5: 2 and 4 to rows 1, 2; 3 and 5 to rows 5, 6
    [(slice(0, 3, 2), 1), (slice(1, 4, 2), 5)]
    >>> rows_placed(2, 4, [(0, 3, 0)])
    [(slice(0, 1, 1), 2)]
    """
    placed = []
    for start, stop, target, *step in runs:
        step = step[0] if step else 1
        skip = max(0, -(-(first - start) // step))          # the run's first row inside the box
        end = min(-(-(stop - start) // step), -(-(first + count - start) // step))  # one past its last
        if skip < end:
            low = start + skip * step - first
            placed.append((slice(low, low + (end - skip - 1) * step + 1, step), target + skip))
    return placed


def _heads(config: dict) -> tuple[int, int, int]:
    """(attention heads, key-value heads, head_dim) of a Hugging Face config."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return heads, kv, int(config.get("head_dim") or config["hidden_size"] // heads)


def _qkv(config: dict) -> FusedQKV:
    return FusedQKV(*_heads(config))


# A mapping table's transform kinds, each with how to build it from a Hugging Face config: the one list of them.
KINDS = {
    "column": lambda config: ColumnParallel(),
    "row": lambda config: RowParallel(),
    "replicated": lambda config: Replicated(),
    "gated": lambda config: GatedMLP(),
    "vocab": lambda config: VocabParallel(int(config["vocab_size"])),
    "qkv": _qkv,
    "rope_q": lambda config: InterleavedRope(_heads(config)[0], _heads(config)[2]),
    "rope_k": lambda config: InterleavedRope(_heads(config)[1], _heads(config)[2]),
}


def make_transform(kind: str, config: dict) -> Transform:
    """The transform a mapping table's `kind` names, sized from a Hugging Face config.

    >>> make_transform("qkv", {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}).group_rows
    64
    """
    if kind not in KINDS:
        raise ValueError(f"unknown transform kind {kind!r} ({', '.join(KINDS)})")
    return KINDS[kind](config)
