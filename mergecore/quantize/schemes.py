"""The schemes as data, which weights each quantizes, the tensors it writes for them and its `quantization_config`.

Quantized: 2-D Linear weights of decoder layers (`...layers.N....weight`), experts included. Unquantized (kept
in the merge dtype): embeddings, `lm_head`, norms, biases, MoE routers and gates, vision towers and projectors
(`DEFAULT_IGNORE`, plus the `quantize_ignore` patterns of the model_type's entry in the family registry,
`mergecore.families.registry`), and whatever `--quantize-ignore PATTERN` names (an
fnmatch pattern on the module name, the tensor name without `.weight`), and weights holding NaN/Inf when the merge
publishes those (`--on-nonfinite warn`: `kept_nonfinite`), since a quantized weight cannot carry them: its block or
group scale would spread one bad value over its neighbours.

>>> spec = quantize_spec("w4a16", ("*.down_proj",))
>>> [(p.name, p.shape, p.dtype) for p in outputs("model.layers.0.mlp.up_proj.weight", (256, 128), "bfloat16", spec)]
[('model.layers.0.mlp.up_proj.weight_packed', (256, 16), 'int32'), ('model.layers.0.mlp.up_proj.weight_scale', (256, 1), 'bfloat16'), ('model.layers.0.mlp.up_proj.weight_shape', (2,), 'int64')]
>>> outputs("model.layers.0.mlp.down_proj.weight", (128, 256), "bfloat16", spec)[0].part is None
True
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..errors import CheckpointError
from ..families.registry import family_of
from .kernels import BLOCK, GROUP


@dataclass(frozen=True)
class Scheme:
    name: str
    kind: str            # "fp8-block" | "int"
    bits: int
    primary: str         # the part whose read drives the others ("weight" / "weight_packed")


SCHEMES = {
    "fp8-block": Scheme("fp8-block", "fp8-block", 8, "weight"),
    "w8a16": Scheme("w8a16", "int", 8, "weight_packed"),
    "w4a16": Scheme("w4a16", "int", 4, "weight_packed"),
}

# Module-name patterns (fnmatch) that stay unquantized in every family; the routers and gates each family names
# its own way are its registry entry's (`Family.quantize_ignore`), so a family is added in one place.
DEFAULT_IGNORE = (
    "*embed_tokens*", "*lm_head*", "*norm*", "*.mlp.gate", "*.router", "*.router.*", "*shared_expert_gate",
    "*visual*", "*vision_tower*", "*vision_model*", "*multi_modal_projector*", "*mm_projector*",
)
_DECODER_WEIGHT = re.compile(r"(^|\.)layers\.\d+\..*\.weight$")


@dataclass(frozen=True)
class PlannedPart:
    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str | None     # None: the tensor itself, unquantized


def quantize_spec(scheme: str | None, ignore: tuple[str, ...] = (), model_type: str | None = None,
                  kept_nonfinite: tuple[str, ...] = ()) -> dict | None:
    """The plan's record of a quantized export (plain data), or None without a scheme; an unknown scheme, a pattern
    that is no pattern and patterns without a scheme are one line each. `kept_nonfinite`: the modules whose weights
    hold NaN/Inf, kept unquantized (`stream.nonfinite_weights`).

    >>> quantize_spec("int3")
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: unknown --quantize 'int3': use fp8-block, w8a16 or w4a16
    >>> quantize_spec(None, ("*.layers.0.*",))
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: --quantize-ignore '*.layers.0.*' given without --quantize: add --quantize fp8-block, w8a16 or w4a16, or drop it
    """
    if scheme is None:
        if ignore:  # silently merging unquantized would hide that the patterns were never used
            raise CheckpointError(f"--quantize-ignore {ignore[0]!r} given without --quantize: add --quantize "
                                  "fp8-block, w8a16 or w4a16, or drop it")
        return None
    if scheme not in SCHEMES:
        raise CheckpointError(f"unknown --quantize {scheme!r}: use fp8-block, w8a16 or w4a16")
    for pattern in ignore:
        if not isinstance(pattern, str) or not pattern.strip():
            raise CheckpointError(f"--quantize-ignore {pattern!r}: give a module name pattern such as '*.layers.0.*'")
    family = family_of({"model_type": model_type})
    patterns = (*DEFAULT_IGNORE, *(family.quantize_ignore if family else ()), *ignore)
    return {"scheme": scheme, "ignore": list(patterns), "user_ignore": list(ignore),
            "kept_nonfinite": sorted(kept_nonfinite)}


def check_ignore_patterns(spec: dict, names, where) -> None:
    """Refuse a `--quantize-ignore` pattern that matches no module of the checkpoint (tensor `names`, at `where`): a
    typo (`*.layer.0.*`) would otherwise keep nothing unquantized and say nothing. Only the plan knows the names, so
    this runs when it is made, before anything is read or written.

    >>> check_ignore_patterns(quantize_spec("w4a16", ("*.layer.0.*",)), ["model.layers.0.mlp.up_proj.weight"], "ckpt")
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: --quantize-ignore '*.layer.0.*' matches no module of ckpt (its modules look like 'model.layers.0.mlp.up_proj'); fix the pattern
    """
    names = list(names)
    modules = {name.rpartition(".")[0] or name for name in names}
    for pattern in spec["user_ignore"]:
        if not any(fnmatch.fnmatchcase(module, pattern) for module in modules):
            example = next((module_of(n) for n in names if _DECODER_WEIGHT.search(n)), min(modules, default=""))
            raise CheckpointError(f"--quantize-ignore {pattern!r} matches no module of {where} (its modules look like "
                                  f"{example!r}); fix the pattern")


def check_quantizes_something(spec: dict, quantized: int, where) -> None:
    """Refuse a plan that quantizes no weight: its config would call plain weights quantized (and loaders would
    look for scales that are not there)."""
    if quantized:
        return
    scheme = spec["scheme"]
    if spec["user_ignore"]:
        patterns = ", ".join(repr(p) for p in spec["user_ignore"])
        raise CheckpointError(f"--quantize-ignore {patterns} leaves no weight of {where} to quantize with --quantize "
                              f"{scheme}: narrow the pattern, or drop --quantize to merge unquantized")
    why = "every one it could quantize holds NaN/Inf" if spec.get("kept_nonfinite") else \
        "it has no decoder Linear weight"
    raise CheckpointError(f"{where}: --quantize {scheme} would quantize no weight ({why}); drop --quantize to merge "
                          "unquantized")


def scheme_of(spec: dict) -> Scheme:
    return SCHEMES[spec["scheme"]]


def module_of(name: str) -> str:
    return name.removesuffix(".weight")


def selected(name: str, shape: tuple[int, ...], spec: dict) -> bool:
    """Whether tensor `name` is quantized under `spec` (a decoder Linear weight no pattern ignores)."""
    if not _DECODER_WEIGHT.search(name) or len(shape) < 2:
        return False
    module = module_of(name)
    if module in spec.get("kept_nonfinite", ()):
        return False
    return not any(fnmatch.fnmatchcase(module, pattern) for pattern in spec["ignore"])


def check_shape(name: str, shape: tuple[int, ...], spec: dict) -> None:
    """Refuse, in one line, a selected weight the scheme cannot quantize in whole blocks."""
    scheme = scheme_of(spec)
    ignore = f"--quantize-ignore '{module_of(name)}'"
    if len(shape) != 2:
        raise CheckpointError(f"{name}: shape {tuple(shape)} is not a 2-D Linear weight, which --quantize {scheme.name} "
                              f"needs (packed experts are not supported); keep it unquantized with {ignore}")
    out, inp = shape
    if scheme.kind == "fp8-block" and (out % BLOCK or inp % BLOCK):
        raise CheckpointError(f"{name}: shape {tuple(shape)} is not a multiple of {BLOCK}x{BLOCK}, which fp8-block needs "
                              f"(transformers' loader decodes whole blocks only); keep it unquantized with {ignore}")
    if scheme.kind == "int" and inp % GROUP:
        raise CheckpointError(f"{name}: {inp} input columns are not a multiple of the group size {GROUP} that "
                              f"--quantize {scheme.name} needs; keep it unquantized with {ignore}")


def outputs(name: str, shape: tuple[int, ...], dtype: str, spec: dict | None) -> list[PlannedPart]:
    """The tensors written for source tensor `name` (`dtype`: the merge's output dtype for it)."""
    if spec is None or not selected(name, shape, spec):
        return [PlannedPart(name, tuple(shape), dtype, None)]
    check_shape(name, shape, spec)
    scheme, module, (out, inp) = scheme_of(spec), module_of(name), shape
    if scheme.kind == "fp8-block":
        return [PlannedPart(name, (out, inp), "float8_e4m3fn", "weight"),
                PlannedPart(f"{module}.weight_scale_inv", (-(-out // BLOCK), -(-inp // BLOCK)), "float32", "weight_scale_inv")]
    return [PlannedPart(f"{module}.weight_packed", (out, inp * scheme.bits // 32), "int32", "weight_packed"),
            PlannedPart(f"{module}.weight_scale", (out, inp // GROUP), dtype, "weight_scale"),
            PlannedPart(f"{module}.weight_shape", (2,), "int64", "weight_shape")]


def quantization_config(spec: dict, unquantized_modules: list[str], dtype: str | None) -> dict:
    """config.json's `quantization_config` for `spec`; `unquantized_modules`: every 2-D weight's module left as is
    (transformers and vLLM would otherwise expect quantized tensors for it)."""
    scheme = scheme_of(spec)
    if scheme.kind == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": unquantized_modules}
    weights = {"num_bits": scheme.bits, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": GROUP, "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": unquantized_modules, "kv_cache_scheme": None}
