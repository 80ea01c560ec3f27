"""LoRA checkpoints (peft wrapped before FSDP, as verl trains them): detection, hyperparameters, fusing.

Long (~560 lines): detection, hyperparameters, the fused view and the adapter writer are one feature, read in
that order.

A full LoRA save holds PEFT names::

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight   [out, r]

(`save_lora_only` keeps just the lora_A/lora_B tensors). `LoraFusedSource` shows such a checkpoint
under the plain Hugging Face names, each adapted weight read as W + (alpha/r)·B·A, computed in fp32 and
cast once, one tensor at a time.

>>> hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
'model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, VerificationError
from ..request import LORA_OUTPUTS
from ..formats.base import CheckpointSource, Piece, TensorInfo

PEFT_PREFIX = "base_model.model."
META_FILE = "lora_train_meta.json"          # verl writes it beside the rank files
ADAPTER_CONFIG = "adapter_config.json"      # peft's own, when a save carries one
_ADAPTER_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>A|B|embedding_A|embedding_B)\.(?P<adapter>[^.]+)(?:\.weight)?$")


def is_lora_name(name: str) -> bool:
    return _ADAPTER_TENSOR.match(name) is not None


def is_lora_checkpoint(names: Iterable[str]) -> bool:
    """PEFT names: the `base_model.model.` prefix with adapter tensors (or only adapter tensors)."""
    names = list(names)
    return any(n.startswith(PEFT_PREFIX) for n in names) and any(is_lora_name(n) for n in names)


def is_lora_only(names: Iterable[str]) -> bool:
    names = list(names)
    return bool(names) and all(is_lora_name(n) for n in names)


def hf_name(peft_name: str) -> str:
    """The Hugging Face name of a base tensor: no PEFT prefix, no `.base_layer`."""
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class AdapterPair:
    """The two factors of one adapted module: delta = B @ A (transposed for embeddings)."""

    module: str      # HF module name, e.g. model.layers.0.self_attn.q_proj
    adapter: str
    a: str           # checkpoint names
    b: str
    embedding: bool


def adapter_pairs(names: Iterable[str]) -> dict[str, AdapterPair]:
    """HF weight name -> its adapter factors. Only one adapter per module is supported."""
    found: dict[tuple[str, str, bool], dict[str, str]] = {}
    for name in names:
        match = _ADAPTER_TENSOR.match(name)
        if match:
            kind = match["kind"]
            key = (match["module"], match["adapter"], kind.startswith("embedding"))
            found.setdefault(key, {})[kind[-1]] = name
    pairs: dict[str, AdapterPair] = {}
    for (module, adapter, embedding), factors in found.items():
        if set(factors) != {"A", "B"}:
            missing = "lora_B" if "A" in factors else "lora_A"
            raise CheckpointError(f"tensor {next(iter(factors.values()))} has no {missing} partner; the save is incomplete: re-copy the checkpoint")
        weight = hf_name(module) + ".weight"
        if weight in pairs:
            raise CheckpointError(
                f"module {hf_name(module)} has adapters {pairs[weight].adapter!r} and {adapter!r}; "
                "fusing more than one adapter per module is not supported"
            )
        pairs[weight] = AdapterPair(hf_name(module), adapter, factors["A"], factors["B"], embedding)
    return pairs


@dataclass(frozen=True)
class LoraHyperparameters:
    r: int
    alpha: float | None
    target_modules: tuple[str, ...]
    adapters: tuple[str, ...]
    use_rslora: bool
    task_type: str | None
    source: dict[str, str]        # field -> where it came from (file name, "tensors" or the flag)

    @property
    def scale(self) -> float:
        """alpha / r (alpha / sqrt(r) with rsLoRA), as peft scales the adapter's output."""
        if self.alpha is None:
            raise CheckpointError(
                "LoRA checkpoint: no lora_alpha in lora_train_meta.json or adapter_config.json; pass --lora-alpha "
                "(the value training used: a wrong alpha gives a different model)"
            )
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict:
        return {**asdict(self), "target_modules": list(self.target_modules), "adapters": list(self.adapters)}


def _metadata(source: CheckpointSource) -> tuple[dict, str | None]:
    """(fields, file shown) from lora_train_meta.json or an adapter_config.json beside the rank files or in huggingface/."""
    from ..storage.tensorio import read_json

    for folder in (source.location, source.hf_dir):
        if folder is None:
            continue
        for file in (META_FILE, ADAPTER_CONFIG):
            where = folder.join(file)
            if where.exists():
                return read_json(where, fix="restore it from the training run, or pass --lora-alpha/--lora-r"), str(where)
    return {}, None


def read_hyperparameters(source: CheckpointSource, names: Iterable[str], overrides: dict | None = None) -> LoraHyperparameters:
    """r, alpha, target modules and adapters: flags first, then the checkpoint's metadata, then the tensors
    (r, modules). Alpha is never guessed: without it `scale` refuses. An r that contradicts the tensors is refused."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    names = list(names)
    tensors = source.tensors()
    pairs = adapter_pairs(names)
    if not pairs:
        raise CheckpointError(f"{source.location}: no lora_A/lora_B tensors; this is not a LoRA checkpoint")
    ranks = {tensors[p.a].shape[1 if p.embedding else 0] for p in pairs.values()}
    meta, meta_file = _metadata(source)
    origin: dict[str, str] = {}

    def pick(field: str, flag: str, meta_keys: tuple[str, ...]):
        if field in overrides:
            origin[field] = flag
            return overrides[field]
        for key in meta_keys:
            if meta.get(key) is not None:
                origin[field] = meta_file
                return meta[key]
        return None

    r = pick("r", "--lora-r", ("r", "lora_rank"))
    if r is None:
        if len(ranks) != 1:
            raise CheckpointError(f"{source.location}: adapters of ranks {sorted(ranks)}; pass --lora-r (per-module ranks are not supported)")
        r, origin["r"] = ranks.pop(), "tensors"
    elif isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise CheckpointError(f"{origin['r']}: r {r!r} is not a positive whole number; fix it or pass --lora-r")
    elif {r} != ranks:
        raise CheckpointError(
            f"{origin['r']}: says r={r} but the lora_A tensors have rank {sorted(ranks)}; fix it or pass --lora-r {min(ranks)}"
        )
    alpha = pick("alpha", "--lora-alpha", ("lora_alpha", "alpha"))
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        raise CheckpointError(f"{origin['alpha']}: lora_alpha {alpha!r} is not a positive number; fix it or pass --lora-alpha")
    found_modules = tuple(sorted({p.module.rsplit(".", 1)[-1] for p in pairs.values()}))
    targets = pick("target_modules", "--target-modules", ("target_modules",))
    if isinstance(targets, str):
        targets = tuple(t for t in re.split(r"[,\s]+", targets) if t)
    if targets is not None and not (isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets)):
        raise CheckpointError(f"{origin['target_modules']}: target_modules {targets!r} is not a list of module names; "
                              "fix it or pass --target-modules")
    if targets is None or targets == "all-linear":
        targets, origin["target_modules"] = found_modules, "tensors"
    stray = sorted(set(found_modules) - set(targets))
    if stray:
        raise CheckpointError(
            f"{origin['target_modules']}: target modules {list(targets)} leave out {stray}, which the checkpoint adapts; "
            f"pass --target-modules {','.join(found_modules)}"
        )
    return LoraHyperparameters(
        r=int(r), alpha=None if alpha is None else float(alpha), target_modules=tuple(targets),
        adapters=tuple(sorted({p.adapter for p in pairs.values()})),
        use_rslora=bool(meta.get("use_rslora", False)), task_type=meta.get("task_type"), source=origin,
    )


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


# ---- the PEFT adapter folder

ADAPTER_FOLDER = "lora_adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_saved_name(name: str, adapter: str) -> str:
    """PEFT's on-disk name: the in-memory one without the adapter name (`lora_A.default.weight` -> `lora_A.weight`)."""
    return name.replace(f".{adapter}.weight", ".weight").replace(f".{adapter}", "")


def adapter_config(hyper: LoraHyperparameters, base_model: str | None) -> dict:
    """peft's adapter_config.json for these hyperparameters (fields peft leaves at defaults are omitted)."""
    return {"peft_type": "LORA", "task_type": hyper.task_type or "CAUSAL_LM", "r": hyper.r,
            "lora_alpha": hyper.alpha, "target_modules": list(hyper.target_modules), "use_rslora": hyper.use_rslora,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_adapter_files(inner: CheckpointSource, hyper: LoraHyperparameters, folder, base_model: str | None = None) -> dict:
    """adapter_config.json + adapter_model.safetensors (PEFT's saved names) in `folder`, every saved piece then
    found bit for bit in the written file, and the files fsynced. Returns {"tensors": n, "pieces": m}."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from ..numbers.arrays import bitwise_equal, cast, dtype_of
    from ..targets.publish import sync_folder
    from ..storage.tensorio import SafetensorsFile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pairs = adapter_pairs(inner.tensors())
    if len(hyper.adapters) != 1:
        raise CheckpointError(f"{inner.location}: adapters {list(hyper.adapters)}; writing more than one adapter is not supported")
    saved = {peft_saved_name(n, p.adapter): n for p in pairs.values() for n in (p.a, p.b)}
    save_file({out: _savable(np.ascontiguousarray(inner.read(n))) for out, n in saved.items()},
              str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(hyper, base_model), indent=2) + "\n")
    pieces = 0
    written = SafetensorsFile(folder / ADAPTER_WEIGHTS)
    for out, n in saved.items():
        value = written.get_tensor(out)
        for piece in inner.pieces(n):
            if not bitwise_equal(value[piece.index], cast(piece.tensor, dtype_of(value))):
                raise VerificationError(f"{piece.source}: adapter tensor {n} differs from {out} as written; "
                                        "do not use it (please report this)")
            pieces += 1
    sync_folder(folder)
    return {"tensors": len(saved), "pieces": pieces}


def adapter_of(source: CheckpointSource, overrides: dict | None = None):
    """(the checkpoint holding the adapter, its hyperparameters) of a LoRA checkpoint, full or save_lora_only,
    validated; refuses without alpha, before anything is written."""
    fused = fused_lora(source)
    inner = fused.inner if fused is not None else source
    hyper = read_hyperparameters(inner, inner.tensors(), overrides)
    hyper.scale  # noqa: B018  (refuses without alpha)
    inner.validate()
    return inner, hyper


def write_adapter_beside(source: CheckpointSource, folder) -> list[str]:
    """For a fused LoRA merge whose output is `both`: the PEFT adapter in `folder/lora_adapter/`; returns the
    files written, relative to `folder` (none for any other source)."""
    source = fused_lora(source)
    if source is None or source.output != "both":
        return []
    write_adapter_files(source.inner, source.hyperparameters, Path(folder) / ADAPTER_FOLDER, source.base_model)
    return [f"{ADAPTER_FOLDER}/{ADAPTER_CONFIG}", f"{ADAPTER_FOLDER}/{ADAPTER_WEIGHTS}"]


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


# ---- the base model of a save_lora_only checkpoint (--base-model)

BASE_FILES = ("*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")  # never pickles (*.bin, *.pt)


def base_model_folder(spec: str) -> Path:
    """A local Hugging Face folder, or a Hub repo id downloaded (safetensors and metadata only) with
    huggingface_hub, which honours HF_ENDPOINT, HF_TOKEN and its cache.

    >>> base_model_folder("Qwen/Qwen2.5-0.5B")  # doctest: +SKIP
    PosixPath('~/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/...')
    """
    local = Path(spec).expanduser()
    if local.is_dir():
        folder = local
    elif local.exists() or spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise CheckpointError(f"--base-model {spec}: not a folder nor a Hub repo id (org/name); pass the base model's "
                              "folder or repo id")
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        try:
            folder = Path(snapshot_download(spec, allow_patterns=list(BASE_FILES)))
        except RepositoryNotFoundError:
            raise CheckpointError(f"--base-model {spec}: no such Hub repo (or no access: set HF_TOKEN); pass the "
                                  "base model's folder or repo id") from None
        except (HfHubHTTPError, OSError) as err:
            reason = " ".join(str(err).split())[:160]
            raise CheckpointError(f"--base-model {spec}: download failed ({reason}); check HF_ENDPOINT/HF_TOKEN "
                                  "or pass a local folder") from None
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"--base-model {spec}: no *.safetensors weights (pickled .bin weights are never "
                              "loaded); convert the base model to safetensors")
    return folder


class BaseModelSource(CheckpointSource):
    """The weights of a Hugging Face folder (safetensors only) as a checkpoint of one piece per tensor,
    each a view of the mmapped file (read per tensor, like every merge)."""

    format_name = "hf-folder"

    def __init__(self, spec: str):
        from ..storage import Location
        from ..storage.tensorio import HfWeights

        self.spec = spec
        self.folder = base_model_folder(spec)
        self.location = self.hf_dir = Location.of(str(self.folder))
        self._weights = HfWeights(self.folder).__enter__()  # mmapped for the life of this source

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        from ..numbers.arrays import dtype_of

        infos = {}
        for name in self._weights.names():
            value = self._weights.get(name)
            infos[name] = TensorInfo(name, tuple(value.shape), dtype_of(value), "plain")
        return infos

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def pieces(self, name: str) -> Iterator[Piece]:
        value = self._weights.get(name)
        yield Piece(f"{self.folder}", (0,) * value.ndim, tuple(value.shape), value)

    def validate(self, check_replicas: bool = False) -> None:
        pass  # a safetensors folder is one consistent file set (HfWeights checked its index)

    def input_files(self, names=None) -> list:
        from ..storage import Location

        return [Location.of(str(p)) for p in sorted(self.folder.glob("*.safetensors"))]

    def describe(self) -> dict:
        return {"format": self.format_name, "location": str(self.folder), "base_model": self.spec}


def _savable(array: np.ndarray) -> np.ndarray:
    """`array` as safetensors.numpy names it: our bfloat16 arrays are uint16 bits, which it would
    save as U16, so they become ml_dtypes' bfloat16 (imported only here, off the merge path)."""
    from ..numbers.arrays import dtype_of

    if dtype_of(array) != "bfloat16":
        return array
    import ml_dtypes

    return array.view(ml_dtypes.bfloat16)
