"""The model families ckptflow knows, as data: one entry per config.json `model_type`, and the one place to add one.

An entry (`Family`) says:

- `names`: the family's Hugging Face parameter names, as shape tables (pattern -> config fields giving its
  shape). Either the name of a table of `mergecore.families.layout` (`"decoder"`, `"moe"`, `"mixtral"`,
  `"qwen2_5_vl_vision"`, `"qwen3_vl_vision"`) or a table given as data. When a family names tables, a tensor
  that none of them names is refused where transformers cannot judge the config (`layout.check_against_config`).
- `hub_layout`: where the names a merge writes come from: `"transformers"` (transformers' own save conversion,
  asked of its meta model by `mergecore.views.hub_layout`; for a family transformers ships) or `"registry"`
  (the checkpoint already holds the Hub's names, those of `names`; for a family transformers does not know).
- `megatron`: the Megatron mapping table (`mergecore.families.megatron_maps` rows), when Megatron checkpoints of
  the family are read.
- `quantize_ignore`: module-name patterns (fnmatch) that a quantized export (`mergecore.quantize.schemes`) keeps
  in the merge dtype for this family, beyond those it keeps for every family: the routers and gates each family
  names its own way.

Beside the entries, one fact for every family (`VALUE_HEADS`): which config.json architectures are a verl
critic's, whose output layer is the value head, not the vocabulary.

A family transformers ships needs no entry to merge from FSDP; Megatron checkpoints need its table, and a quantized
export its own router names. Adding one is a call, no change to the library (docs/adding-a-family.md):

>>> from mergecore.families.megatron_maps import ATTENTION_ROWS, DENSE_MLP_ROWS, EMBEDDING_ROWS, HEAD_ROWS
>>> register_family("acme_doc", names=("decoder",), hub_layout="registry",
...                 megatron={**EMBEDDING_ROWS, **ATTENTION_ROWS, **DENSE_MLP_ROWS, **HEAD_ROWS},
...                 quantize_ignore="*.mlp.acme_router").quantize_ignore
('*.mlp.acme_router',)
>>> family_of({"model_type": "acme_doc"}).model_type
'acme_doc'
>>> forget_family("acme_doc")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import CheckpointError
from .megatron_maps import (ATTENTION_ROWS, DENSE_MLP_ROWS, EMBEDDING_ROWS, HEAD_ROWS, MOE_ROWS, QK_NORM_ROWS,
                            QKV_BIAS_ROWS, SHARED_EXPERT_ROWS, VALUE_HEAD_ROWS, Table, parse_rows)

__all__ = ["Family", "register_family", "forget_family", "family_of", "registered", "table_for", "HUB_LAYOUTS",
           "VALUE_HEADS", "names_value_head"]

# Where a family's Hub names come from (see the module docstring).
HUB_LAYOUTS = ("transformers", "registry")
# A verl critic's architecture (suffixes of config.json's `architectures[0]`, any family): its output layer is the
# value head (`score`), not the vocabulary.
VALUE_HEADS = ("ForTokenClassification", "ForSequenceClassification")


@dataclass(frozen=True)
class Family:
    """One model family: its Hub names, where its Hub layout comes from, its Megatron table (or None), the modules
    a quantized export keeps unquantized for it."""

    model_type: str
    names: tuple[str | Mapping, ...] = ()
    hub_layout: str = "transformers"
    megatron: Table | None = None
    quantize_ignore: tuple[str, ...] = ()


_FAMILIES: dict[str, Family] = {}


def register_family(model_type: str, *, names=(), hub_layout: str = "transformers", megatron: Mapping | None = None,
                    quantize_ignore=(), replace: bool = False) -> Family:
    """Add a family (or, with `replace=True`, change one); its Megatron rows are checked as a custom mapping's
    are. Returns the entry. A wrong argument is a one-line CheckpointError naming it.

    >>> register_family("acme_doc", quantize_ignore=("*.mlp.acme_router", ""))
    Traceback (most recent call last):
    mergecore.errors.CheckpointError: register_family('acme_doc'): quantize_ignore '' is no module name pattern: give fnmatch patterns such as '*.mlp.gate'
    """
    where = f"register_family({model_type!r})"
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{where}: model_type must be config.json's model_type (a non-empty string)")
    if model_type in _FAMILIES and not replace:
        raise CheckpointError(f"{where}: already registered; pass replace=True to change it")
    if hub_layout not in HUB_LAYOUTS:
        raise CheckpointError(f"{where}: hub_layout {hub_layout!r} is not one of {', '.join(HUB_LAYOUTS)}")
    names = (names,) if isinstance(names, (str, Mapping)) else tuple(names)
    if not all(isinstance(n, (str, Mapping)) for n in names):
        raise CheckpointError(f"{where}: names must be table names of mergecore.families.layout or "
                              "{pattern: shape fields} tables")
    if hub_layout == "registry" and not names:
        raise CheckpointError(f"{where}: hub_layout 'registry' needs the family's names (its Hub name tables)")
    # one pattern given bare would otherwise be read as patterns of one character each
    quantize_ignore = (quantize_ignore,) if isinstance(quantize_ignore, str) else tuple(quantize_ignore)
    for pattern in quantize_ignore:
        if not isinstance(pattern, str) or not pattern.strip():
            raise CheckpointError(f"{where}: quantize_ignore {pattern!r} is no module name pattern: give fnmatch "
                                  "patterns such as '*.mlp.gate'")
    rows = parse_rows(dict(megatron), f"{where}: megatron") if megatron is not None else None
    entry = Family(model_type, names, hub_layout, rows, quantize_ignore)
    _FAMILIES[model_type] = entry
    return entry


def forget_family(model_type: str) -> None:
    """Remove a registered family (tests, a user undoing a registration); unknown ones are ignored."""
    _FAMILIES.pop(model_type, None)


def family_of(config: dict) -> Family | None:
    """The registered family of config.json's `model_type`, or None."""
    model_type = config.get("model_type")
    return _FAMILIES.get(model_type) if isinstance(model_type, str) else None


def registered() -> tuple[str, ...]:
    """The registered model types, in registration order."""
    return tuple(_FAMILIES)


def names_value_head(config: dict) -> bool:
    """Whether config.json names a critic's architecture (`VALUE_HEADS`), whatever its family.

    >>> names_value_head({"architectures": ["Qwen2ForTokenClassification"]}), names_value_head({"model_type": "qwen2"})
    (True, False)
    """
    architectures = config.get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    return isinstance(named, str) and named.endswith(VALUE_HEADS)


def table_for(config: dict, custom: Table | None = None, value_model: bool = False, config_file=None) -> Table:
    """The Megatron table of config.json's family, custom rows first; a value model maps the output layer to
    `score`. A family with no table and no custom rows fails in one line naming both fixes."""
    model_type = config.get("model_type")
    family = family_of(config)
    base = family.megatron if family else None
    if base is None and not custom:
        known = ", ".join(t for t, f in _FAMILIES.items() if f.megatron is not None)
        raise CheckpointError(
            f"{str(config_file) + ': ' if config_file else ''}model_type {model_type!r} has no Megatron mapping table "
            f"(families with one: {known}); register the family with its table (mergecore.families.register_family, "
            "see docs/adding-a-family.md) or pass --custom-mapping FILE with its parameter names"
        )
    table = dict(custom or {})
    for pattern, row in (base or {}).items():
        if value_model and pattern in HEAD_ROWS and pattern.startswith("output_layer"):
            continue
        table.setdefault(pattern, row)
    if value_model:
        for pattern, row in VALUE_HEAD_ROWS.items():
            table.setdefault(pattern, row)
    return table


# ---- the families ckptflow ships ----------------------------------------------------------------------------

_DENSE = {**EMBEDDING_ROWS, **ATTENTION_ROWS, **DENSE_MLP_ROWS, **HEAD_ROWS}
for _type, _megatron in {
    "llama": _DENSE,
    "mistral": _DENSE,
    "qwen2": {**EMBEDDING_ROWS, **ATTENTION_ROWS, **QKV_BIAS_ROWS, **DENSE_MLP_ROWS, **HEAD_ROWS},
    "qwen3": {**EMBEDDING_ROWS, **ATTENTION_ROWS, **QK_NORM_ROWS, **DENSE_MLP_ROWS, **HEAD_ROWS},
}.items():
    register_family(_type, names=("decoder",), megatron=_megatron)
register_family("qwen2_moe", names=("decoder", "moe"), megatron={
    **EMBEDDING_ROWS, **ATTENTION_ROWS, **QKV_BIAS_ROWS, **MOE_ROWS, **SHARED_EXPERT_ROWS, **DENSE_MLP_ROWS,
    **HEAD_ROWS}, quantize_ignore=("*.mlp.shared_expert_gate",))
register_family("qwen3_moe", names=("decoder", "moe"), megatron={
    **EMBEDDING_ROWS, **ATTENTION_ROWS, **QK_NORM_ROWS, **MOE_ROWS, **DENSE_MLP_ROWS, **HEAD_ROWS})
register_family("mixtral", names=("decoder", "mixtral"), quantize_ignore=("*.block_sparse_moe.gate",))
register_family("qwen2_5_vl", names=("decoder", "qwen2_5_vl_vision"))
register_family("qwen3_vl", names=("decoder", "qwen3_vl_vision"))
# Families transformers ships whose routers and gates a quantized export must know by name; their tensors are
# judged by transformers' own model (no name tables here).
register_family("deepseek_v3", quantize_ignore=("*.mlp.gate",))
register_family("gpt_oss", quantize_ignore=("*.mlp.router",))
register_family("qwen3_next", quantize_ignore=("*.mlp.shared_expert_gate", "*.linear_attn.*"))
