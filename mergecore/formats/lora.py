"""A LoRA save as verl writes it (peft wrapped before FSDP): the PEFT names, the adapter pairs, the hyperparameters.

A full LoRA save holds PEFT names::

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight   [out, r]

(`save_lora_only` keeps just the lora_A/lora_B tensors), with r and alpha in `lora_train_meta.json` (or a PEFT
`adapter_config.json`) beside the rank files. What reads such a save lives here, below both of its users: the
fused view (`views/lora.py`) and the adapter writer (`model/adapter.py`).

>>> hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
'model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..errors import CheckpointError
from .base import CheckpointSource

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
