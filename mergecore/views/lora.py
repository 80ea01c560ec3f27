"""LoRA checkpoints (peft wrapped before FSDP, as verl trains them) seen fused: `LoraFusedSource` shows a full LoRA
save (or a save_lora_only one with `--base-model`) under the plain Hugging Face names, each adapted weight read as
W + (alpha/r)·B·A, computed in fp32 and cast once, one tensor at a time; and what a LoRA merge writes
(`output_mode`: the fused model, the PEFT adapter alone, or both).

The PEFT names and hyperparameters are read by `formats/lora.py`, the `--base-model` weights by
`formats/base_model.py`; the adapter folder is written by `model/adapter.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import numpy as np

from ..errors import CheckpointError, VerificationError
from ..formats.base import CheckpointSource, Piece, TensorInfo
from ..formats.base_model import BaseModelSource
from ..formats.lora import (
    AdapterPair, LoraHyperparameters, adapter_pairs, hf_name, is_lora_checkpoint, is_lora_name, is_lora_only,
    read_hyperparameters,
)

LORA_OUTPUTS = ("fuse", "adapter", "both")  # the fused model, the PEFT adapter folder alone, or the fused model with it


_DELTA_TILE = 256  # output rows per matmul: see add_fused_delta


def add_fused_delta(into: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float, embedding: bool, start: int) -> None:
    """`into += rows [start, start + len(into))` of scale · B @ A in fp32 (transposed for embeddings, whose A
    is [r, vocab] and B [dim, r], as in peft).

    The product is taken in fixed tiles of `_DELTA_TILE` output rows aligned to multiples of it, so a row's
    value never depends on how the caller blocks the rows (BLAS may round another shape differently): the
    merge streams row blocks of any size and the round-trip check rebuilds them bit for bit.
    """
    a, b = a.astype(np.float32, copy=False), b.astype(np.float32, copy=False)
    rows = a.shape[1] if embedding else b.shape[0]
    stop = start + into.shape[0]
    for tile in range(start // _DELTA_TILE * _DELTA_TILE, stop, _DELTA_TILE):
        end = min(tile + _DELTA_TILE, rows)
        delta = (b @ a[:, tile:end]).T if embedding else b[tile:end] @ a
        delta *= np.float32(scale)
        low, high = max(start, tile), min(stop, end)
        into[low - start:high - start] += delta[low - tile:high - tile]


class LoraFusedSource(CheckpointSource):
    """A full LoRA checkpoint seen as the fused model under Hugging Face names.

    Every other part of the merge (plan, groups, writer, verification) works on it unchanged.
    """

    def __init__(self, inner: CheckpointSource, overrides: dict | None = None):
        self.inner = inner
        self.overrides = dict(overrides or {})
        self.output = self.overrides.pop("output", None) or "both"   # "both": the adapter folder too
        if self.output not in ("fuse", "both"):
            raise CheckpointError(f"--lora {self.output}: a fused merge writes fuse or both")
        self.base_model = self.overrides.pop("base_model", None)
        # where the base weights come from: the checkpoint itself, or (save_lora_only) the --base-model folder
        self.weights = BaseModelSource(self.base_model) if self.base_model else inner
        self.format_name = inner.format_name
        self.backend = inner.backend
        self.location = inner.location
        has_config = inner.hf_dir is not None and inner.hf_dir.join("config.json").exists()
        self.hf_dir = inner.hf_dir if has_config or not self.base_model else self.weights.hf_dir
        self.step = getattr(inner, "step", None)

    @cached_property
    def hyperparameters(self) -> LoraHyperparameters:
        return read_hyperparameters(self.inner, self.inner.tensors(), self.overrides)

    @cached_property
    def _pairs(self) -> dict[str, AdapterPair]:
        return adapter_pairs(self.inner.tensors())

    @cached_property
    def _names(self) -> dict[str, str]:
        """HF name -> name in `self.weights` of every base tensor."""
        return {hf_name(n): n for n in self.weights.tensors() if not is_lora_name(n)}

    def tensors(self) -> dict[str, TensorInfo]:
        infos = self.weights.tensors()
        return {hf: TensorInfo(hf, infos[n].shape, infos[n].dtype, infos[n].layout) for hf, n in self._names.items()}

    def validate(self, check_replicas: bool = False) -> None:
        self.inner.validate(check_replicas)
        if is_lora_only(self.inner.tensors()) and not self.base_model:
            raise CheckpointError(
                f"{self.location}: holds only LoRA adapter tensors (save_lora_only); there is no base model to fuse "
                "into: pass --base-model PATH_OR_REPO"
            )
        if self.base_model and not is_lora_only(self.inner.tensors()):
            raise CheckpointError(f"--base-model {self.base_model}: {self.location} holds its own base weights (a full "
                                  "LoRA save); drop --base-model")
        whose = f"--base-model {self.base_model}" if self.base_model else str(self.location)
        orphans = sorted(set(self._pairs) - set(self._names))
        if orphans:
            fix = "pass the base model the adapter was trained on" if self.base_model else "the save is incomplete"
            raise CheckpointError(f"{whose}: adapter for {orphans[0]} but no base weight of that name; {fix}")
        infos, base = self.inner.tensors(), self.weights.tensors()
        for weight, pair in self._pairs.items():
            out, inp = base[self._names[weight]].shape[:2]
            a, b = infos[pair.a].shape, infos[pair.b].shape
            want = ((self.hyperparameters.r, out), (inp, self.hyperparameters.r)) if pair.embedding else \
                ((self.hyperparameters.r, inp), (out, self.hyperparameters.r))
            if (a, b) != want:
                if self.base_model:
                    raise CheckpointError(f"--base-model {self.base_model}: {weight} is {base[self._names[weight]].shape} "
                                          f"but the adapter has A {a}, B {b}; pass the base model the adapter was trained on")
                raise CheckpointError(f"{self.location}: adapter of {weight} has A {a}, B {b}, expected {want}; the save is inconsistent")
        self.hyperparameters.scale  # noqa: B018  (refuses now, before anything is written, when alpha is unknown)

    def pieces(self, name: str) -> Iterator[Piece]:
        return self.weights.pieces(self._names[name])

    def streams(self, name: str) -> bool:
        return self.weights.streams(self._names[name])  # a fused tensor's rows need only the base's same rows

    def adapted(self, name: str) -> bool:
        """Whether `name` is computed (W + scale·B·A) rather than read as saved."""
        return name in self._pairs

    def prefetch(self, names) -> None:
        if not self.base_model:
            self.inner.prefetch([self._names.get(n, n) for n in names])

    def input_files(self, names=None) -> list:
        if self.base_model:
            return self.inner.input_files() + self.weights.input_files()
        return self.inner.input_files(None if names is None else [self._names.get(n, n) for n in names])

    def describe(self) -> dict:
        lora = {**self.hyperparameters.to_dict(), "output": self.output}
        return {**self.inner.describe(), "lora": {**lora, "base_model": self.base_model} if self.base_model else lora}

    @property
    def identity(self) -> dict:
        """What the output depends on beyond the input files: for cache keys and reuse."""
        hyper = self.hyperparameters
        found = {"r": hyper.r, "alpha": hyper.alpha, "use_rslora": hyper.use_rslora, "output": self.output}
        return {**found, "base_model": self.base_model} if self.base_model else found

    def read_rows(self, name: str, start: int, stop: int, dtype: str | None = None):
        """Rows [start, stop) of `name`: as saved, or fused as W + scale·B·A in fp32 and cast once (A and B are
        small: r rows or columns), so a fused tensor streams in row blocks like any other."""
        from ..numbers.arrays import cast

        pair = self._pairs.get(name)
        if pair is None:
            return self.weights.read_rows(self._names[name], start, stop, dtype)
        fused = self.weights.read_rows(self._names[name], start, stop, "float32")
        add_fused_delta(fused, self.inner.read(pair.a, "float32"), self.inner.read(pair.b, "float32"),
                        self.hyperparameters.scale, pair.embedding, start)
        return cast(fused, dtype or self.tensors()[name].dtype)

    def check_round_trip(self, name: str, merged) -> int:
        """Plain tensors: every piece re-found bit for bit. Fused ones: every base, A and B piece is read (HSDP
        replicas must equal the piece they copy), and the output must equal W + (alpha/r)·B·A rebuilt from the
        rank files, block of rows by block."""
        from ..numbers.arrays import bitwise_equal, dtype_of, to_numpy
        from ..numbers.budget import chunk_bytes, row_spans

        pair = self._pairs.get(name)
        if pair is None:
            return self.weights.check_round_trip(self._names[name], merged)
        merged = to_numpy(merged)
        count = sum(_replicas_agree(holder, saved) for holder, saved in
                    ((self.weights, self._names[name]), (self.inner, pair.a), (self.inner, pair.b)))
        for low, high in row_spans(merged.shape, 4, chunk_bytes()):
            if not bitwise_equal(self.read_rows(name, low, high, dtype_of(merged)), merged[low:high]):
                raise VerificationError(
                    f"{self.location}: fused tensor {name} differs from W + (alpha/r)·B·A rebuilt from the rank files; "
                    "the merge is wrong: do not publish it (please report this)"
                )
        return count


def _replicas_agree(holder: CheckpointSource, name: str) -> int:
    """The number of saved pieces of `name`; each HSDP replica must hold its primary piece's values."""
    from ..numbers.arrays import bitwise_equal

    pieces = list(holder.pieces(name))
    primary = {piece.offsets: piece for piece in pieces if piece.primary}
    for piece in pieces:
        if not piece.primary and not bitwise_equal(piece.tensor, primary[piece.offsets].tensor):
            raise VerificationError(f"{piece.source}: tensor {name} differs from its replica; "
                                    "the replicas diverged: pick the replica to trust and re-save")
    return len(pieces)


def fused_lora(source: CheckpointSource) -> LoraFusedSource | None:
    """The fused LoRA view inside `source` (itself, or under later views such as the Hub layout), if any."""
    while source is not None and not isinstance(source, LoraFusedSource):
        source = getattr(source, "inner", None)
    return source


def lora_view(source: CheckpointSource, overrides: dict | None = None) -> CheckpointSource:
    """The source as the merge should see it: fused under HF names for a LoRA checkpoint, else unchanged."""
    if fused_lora(source) is not None or source.format_name != "verl-fsdp":
        return source
    if not is_lora_checkpoint(source.tensors()):
        return source
    return LoraFusedSource(source, overrides)


def adapter_of(source: CheckpointSource, overrides: dict | None = None):
    """(the checkpoint holding the adapter, its hyperparameters) of a LoRA checkpoint, full or save_lora_only,
    validated; refuses without alpha, before anything is written."""
    fused = fused_lora(source)
    inner = fused.inner if fused is not None else source
    hyper = read_hyperparameters(inner, inner.tensors(), overrides)
    hyper.scale  # noqa: B018  (refuses without alpha)
    inner.validate()
    return inner, hyper


def output_mode(source: CheckpointSource, requested: str | None, base_model: str | None = None,
                quantize: str | None = None) -> str | None:
    """What a merge of `source` writes: None (not LoRA); for a full save "both" (default: the fused model with
    the adapter in lora_adapter/), "fuse" or "adapter"; for save_lora_only "adapter" only, unless `base_model`
    (--base-model) gives the weights to fuse into: then as for a full save. Contradictions are refused in one line,
    `quantize` with an adapter-only output among them (only a fused model is quantized)."""
    mode = _output_mode(source, requested, base_model)
    if mode == "adapter" and quantize:
        fix = "pass --base-model PATH_OR_REPO to fuse it" if requested is None else \
            "use --lora fuse or both (with --base-model for a save_lora_only checkpoint)"
        raise CheckpointError(f"{source.location}: --quantize {quantize} quantizes a fused model, but this merge "
                              f"writes the LoRA adapter alone (unquantized); {fix}, or drop --quantize")
    return mode


def _output_mode(source: CheckpointSource, requested: str | None, base_model: str | None) -> str | None:
    names = list(source.tensors()) if source.format_name == "verl-fsdp" else []
    lora = bool(names) and is_lora_checkpoint(names)
    if requested is not None and requested not in LORA_OUTPUTS:
        raise CheckpointError(f"--lora {requested}: choose one of {', '.join(LORA_OUTPUTS)}")
    if not lora:
        if requested is not None or base_model:
            flag = f"--lora {requested}" if requested is not None else f"--base-model {base_model}"
            raise CheckpointError(f"{source.location}: {flag} given but the checkpoint has no LoRA adapter tensors; drop the flag")
        return None
    if base_model and not is_lora_only(names):
        raise CheckpointError(f"--base-model {base_model}: {source.location} holds its own base weights (a full LoRA "
                              "save); drop --base-model")
    if is_lora_only(names) and not base_model:
        if requested in ("fuse", "both"):
            raise CheckpointError(f"{source.location}: holds only adapter tensors (save_lora_only): there is no base model "
                                  f"to fuse into; pass --base-model PATH_OR_REPO or drop --lora {requested}")
        return "adapter"
    return requested or "both"
