"""The merge plan: which tensor goes to which output file at which byte offset.

Shapes and dtypes are known before any value is read, so the plan fixes every safetensors header
up front; groups can then be written in any order, by any worker, straight to their final bytes.
The plan is plain data (JSON round-trips), so it can be handed to pipeline tasks as input.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..numbers.arrays import FLOATING, element_size, safetensors_dtype
from ..numbers.dtypes import resolve_dtype

from ..formats.base import TensorInfo
from ..families.layout import EMBEDDING, OUTPUT, group_of
from ..quantize.schemes import check_quantizes_something, module_of, outputs, quantization_config
from ..model.folder import INDEX_FILE

# What a quantized model's unquantized tensors (embeddings, head, norms, biases, int scales) are written in under
# `--dtype auto`: what FP8/INT4 releases ship and loaders expect, half a float32 checkpoint's bytes.
QUANTIZED_AUTO_DTYPE = "bfloat16"


def output_dtype(requested: str, config: dict, quantize: str | None = None) -> str | None:
    """The dtype the plan writes floating tensors in (None: each keeps its own), decided here once; the writers and
    `verify` read it from the plan. `auto` is config.json's dtype, or bf16 under `--quantize`; a dtype given decides.

    >>> output_dtype("auto", {"torch_dtype": "float32"}), output_dtype("auto", {"torch_dtype": "float32"}, "w4a16")
    ('float32', 'bfloat16')
    >>> output_dtype("fp32", {}, "w4a16")
    'float32'
    """
    if quantize and str(requested).lower() == "auto":
        return QUANTIZED_AUTO_DTYPE
    return resolve_dtype(requested, config)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str          # output dtype, torch spelling ("bfloat16")
    source_dtype: str
    group: str
    file: str
    begin: int          # byte offsets within the file's data section (after the header)
    end: int
    source_name: str | None = None  # quantized export: the checkpoint tensor this part is computed from
    part: str | None = None         # ... and which part ("weight_packed", "weight_scale"...); None: the tensor itself


@dataclass
class MergePlan:
    source: str
    dtype: str | None                   # requested output dtype; None keeps each tensor's dtype
    groups: list[str]
    tensors: list[PlannedTensor]
    files: list[str]
    aliases: dict[str, str] = field(default_factory=dict)  # dropped source name -> output name holding it
    quantization: dict | None = None    # `quantize.schemes.quantize_spec` plus the config.json entry; None: plain merge

    def in_group(self, group: str) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.group == group]

    def in_file(self, file: str) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.file == file]

    def units(self, kind: str) -> list[str]:
        """What one step of the merge writes, as a target of `kind` takes it: "groups" (layer groups, rows at their
        offsets in pre-sized files) or "files" (output files, each streamed whole). The one place that tells them
        apart; the engine, the targets, the tasks and the CLI ask here.

        >>> plan.units("groups"), plan.units("files")  # doctest: +SKIP
        (['embed', 'layers.0', 'head'], ['model-00001-of-00001.safetensors'])
        """
        return self.files if kind == "files" else self.groups

    def in_unit(self, unit: str) -> list[PlannedTensor]:
        """The tensors one unit writes (a group's or a file's: their names never meet)."""
        return self.in_file(unit) if unit in self.files else self.in_group(unit)

    def header(self, file: str) -> bytes:
        """The safetensors header of `file`: 8-byte little-endian length + JSON, padded to 8 bytes."""
        entries = {"__metadata__": {"format": "pt"}}
        for t in self.in_file(file):
            entries[t.name] = {"dtype": safetensors_dtype(t.dtype), "shape": list(t.shape),
                               "data_offsets": [t.begin, t.end]}
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text

    def file_size(self, file: str) -> int:
        return len(self.header(file)) + max((t.end for t in self.in_file(file)), default=0)

    def index(self) -> dict:
        """The `model.safetensors.index.json` content."""
        total = sum(t.end - t.begin for t in self.tensors)
        return {"metadata": {"total_size": total}, "weight_map": {t.name: t.file for t in self.tensors}}


def make_plan(
    source: str,
    tensors: dict[str, TensorInfo],
    dtype: str | None,
    tied: bool | dict[str, str],
    max_shard_size: int,
    quantize: dict | None = None,
) -> MergePlan:
    """Group tensors by layer and pack the groups, in order, into files of at most `max_shard_size`.

    Floating-point tensors are cast to `dtype`; others keep theirs. With tied embeddings the
    output head is dropped (Hugging Face stores it once) and recorded as an alias; a mapping names the tied
    tensors to drop instead (dropped name -> the written name holding its values, `config_check.tied_aliases`).
    With `quantize` (`quantize.schemes.quantize_spec`) each selected weight becomes its quantized parts, counted
    as such.
    """
    if isinstance(tied, dict):
        aliases = dict(tied)
    else:
        aliases = {OUTPUT: EMBEDDING} if tied and OUTPUT in tensors and EMBEDDING in tensors else {}
    ordered = sorted((i, n) for i, n in enumerate(tensors) if n not in aliases)
    ordered.sort(key=lambda item: (group_of(item[1])[0], item[0]))

    planned, groups, file_sizes = [], [], [0]
    for _, name in ordered:
        info = tensors[name]
        out_name = dtype if dtype is not None and info.dtype in FLOATING else info.dtype
        parts = outputs(name, info.shape, out_name, quantize)
        nbytes = sum(_numel(p.shape) * element_size(p.dtype) for p in parts)
        if file_sizes[-1] and file_sizes[-1] + nbytes > max_shard_size:
            file_sizes.append(0)
        group = group_of(name)[1]
        if group not in groups:
            groups.append(group)
        for p in parts:
            begin = file_sizes[-1]
            file_sizes[-1] += _numel(p.shape) * element_size(p.dtype)
            planned.append(PlannedTensor(p.name, p.shape, p.dtype, info.dtype, group, str(len(file_sizes)), begin,
                                         file_sizes[-1], name if p.part else None, p.part))

    count = len(file_sizes)
    names = {str(i): f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    planned = [PlannedTensor(**{**asdict(t), "file": names[t.file]}) for t in planned]
    return MergePlan(
        source=source,
        dtype=dtype,
        groups=groups,
        tensors=planned,
        files=list(names.values()),
        aliases=aliases,
        quantization=_quantization(quantize, planned, dtype, source),
    )


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _quantization(spec: dict | None, planned: list[PlannedTensor], dtype, source: str) -> dict | None:
    """The plan's quantization record: the spec, what was quantized, what was not, and config.json's entry (a plan
    quantizing nothing is refused: `check_quantizes_something`)."""
    if spec is None:
        return None

    quantized = sorted({t.source_name for t in planned if t.part})
    check_quantizes_something(spec, len(quantized), source)
    kept = [module_of(t.name) for t in planned if not t.part and len(t.shape) >= 2 and t.name.endswith(".weight")]
    if "lm_head" not in kept:
        kept.append("lm_head")  # a tied head is not written, but is a Linear the loader must leave alone
    return {**spec, "quantized": len(quantized), "unquantized_modules": kept,
            "config": quantization_config(spec, kept, dtype)}


def output_config(config: dict, plan: MergePlan) -> dict:
    """config.json as trained, declaring the dtype the weights were written in."""
    config = dict(config)
    floating = [t.dtype for t in plan.tensors if t.dtype in FLOATING]
    written = plan.dtype or max(set(floating), key=floating.count, default=None)
    if written:
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = written
    if plan.quantization:  # how transformers and vLLM read the quantized weights
        config["quantization_config"] = plan.quantization["config"]
    return config
