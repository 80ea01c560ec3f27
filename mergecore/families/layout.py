"""Hugging Face decoder layouts as data: parameter name patterns and the config fields giving shapes.

Used to group tensors by layer, to check Megatron mappings, and, only where transformers has no class for a
config.json (custom code, an unknown model_type), to prove a checkpoint matches it: every other config is checked
by transformers' own model (`mergecore.families.config_check`).
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..numbers.claims import exactly
from .registry import family_of

# Shapes are tuples of derived config fields (see `dimensions`). `{}` is the layer index.
DECODER_SHAPES: dict[str, tuple[str, ...]] = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "model.layers.{}.self_attn.q_proj.weight": ("q_size", "hidden_size"),
    "model.layers.{}.self_attn.q_proj.bias": ("q_size",),
    "model.layers.{}.self_attn.k_proj.weight": ("kv_size", "hidden_size"),
    "model.layers.{}.self_attn.k_proj.bias": ("kv_size",),
    "model.layers.{}.self_attn.v_proj.weight": ("kv_size", "hidden_size"),
    "model.layers.{}.self_attn.v_proj.bias": ("kv_size",),
    "model.layers.{}.self_attn.o_proj.weight": ("hidden_size", "q_size"),
    "model.layers.{}.self_attn.q_norm.weight": ("head_dim",),
    "model.layers.{}.self_attn.k_norm.weight": ("head_dim",),
    "model.layers.{}.mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "model.layers.{}.input_layernorm.weight": ("hidden_size",),
    "model.layers.{}.post_attention_layernorm.weight": ("hidden_size",),
    "model.norm.weight": ("hidden_size",),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "score.weight": ("num_labels", "hidden_size"),
    "score.bias": ("num_labels",),
}
# Mixture-of-experts rows (Hub layout). A second `{}` is the expert index: every MoE layer holds experts
# 0..num_experts-1. Qwen2/3-MoE experts are `moe_intermediate_size` wide, Mixtral's `intermediate_size`.
MOE_SHAPES: dict[str, tuple[str | int, ...]] = {
    "model.layers.{}.mlp.gate.weight": ("num_experts", "hidden_size"),
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": ("moe_intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.experts.{}.up_proj.weight": ("moe_intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.experts.{}.down_proj.weight": ("hidden_size", "moe_intermediate_size"),
    "model.layers.{}.mlp.shared_expert.gate_proj.weight": ("shared_expert_intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.shared_expert.up_proj.weight": ("shared_expert_intermediate_size", "hidden_size"),
    "model.layers.{}.mlp.shared_expert.down_proj.weight": ("hidden_size", "shared_expert_intermediate_size"),
    "model.layers.{}.mlp.shared_expert_gate.weight": (1, "hidden_size"),
}
MIXTRAL_SHAPES: dict[str, tuple[str | int, ...]] = {
    "model.layers.{}.block_sparse_moe.gate.weight": ("num_experts", "hidden_size"),
    "model.layers.{}.block_sparse_moe.experts.{}.w1.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.block_sparse_moe.experts.{}.w3.weight": ("intermediate_size", "hidden_size"),
    "model.layers.{}.block_sparse_moe.experts.{}.w2.weight": ("hidden_size", "intermediate_size"),
}
# Vision towers, under `visual.` (Qwen2.5-VL's Hub names; Qwen3-VL's `model.visual.` is read as `visual.`).
# Sizes come from config["vision_config"]; `{}` is the vision block (0..depth-1).
_VISION_BLOCK_ATTENTION: dict[str, tuple[str | int, ...]] = {
    "visual.blocks.{}.attn.qkv.weight": ("vision_qkv_size", "vision_hidden_size"),
    "visual.blocks.{}.attn.qkv.bias": ("vision_qkv_size",),
    "visual.blocks.{}.attn.proj.weight": ("vision_hidden_size", "vision_hidden_size"),
    "visual.blocks.{}.attn.proj.bias": ("vision_hidden_size",),
    "visual.blocks.{}.norm1.weight": ("vision_hidden_size",),
    "visual.blocks.{}.norm2.weight": ("vision_hidden_size",),
    "visual.patch_embed.proj.weight": ("vision_hidden_size", "in_channels", "temporal_patch_size", "patch_size", "patch_size"),
}
QWEN2_5_VL_VISION_SHAPES: dict[str, tuple[str | int, ...]] = {
    **_VISION_BLOCK_ATTENTION,
    **{f"visual.blocks.{{}}.mlp.{proj}_proj.{kind}": ("vision_intermediate_size", "vision_hidden_size")[:n]
       for proj in ("gate", "up") for kind, n in (("weight", 2), ("bias", 1))},
    "visual.blocks.{}.mlp.down_proj.weight": ("vision_hidden_size", "vision_intermediate_size"),
    "visual.blocks.{}.mlp.down_proj.bias": ("vision_hidden_size",),
    "visual.merger.ln_q.weight": ("vision_hidden_size",),
    "visual.merger.mlp.0.weight": ("vision_merged_size", "vision_merged_size"),
    "visual.merger.mlp.0.bias": ("vision_merged_size",),
    "visual.merger.mlp.2.weight": ("hidden_size", "vision_merged_size"),
    "visual.merger.mlp.2.bias": ("hidden_size",),
}
QWEN3_VL_VISION_SHAPES: dict[str, tuple[str | int, ...]] = {
    **_VISION_BLOCK_ATTENTION,
    "visual.blocks.{}.norm1.bias": ("vision_hidden_size",),
    "visual.blocks.{}.norm2.bias": ("vision_hidden_size",),
    "visual.blocks.{}.mlp.linear_fc1.weight": ("vision_intermediate_size", "vision_hidden_size"),
    "visual.blocks.{}.mlp.linear_fc1.bias": ("vision_intermediate_size",),
    "visual.blocks.{}.mlp.linear_fc2.weight": ("vision_hidden_size", "vision_intermediate_size"),
    "visual.blocks.{}.mlp.linear_fc2.bias": ("vision_hidden_size",),
    "visual.patch_embed.proj.bias": ("vision_hidden_size",),
    "visual.pos_embed.weight": ("num_position_embeddings", "vision_hidden_size"),
    "visual.merger.norm.weight": ("vision_hidden_size",),
    "visual.merger.norm.bias": ("vision_hidden_size",),
    **{f"visual.{merger}.{part}": shape
       for merger in ("merger", "deepstack_merger_list.{}")
       for part, shape in (("linear_fc1.weight", ("vision_merged_size", "vision_merged_size")),
                           ("linear_fc1.bias", ("vision_merged_size",)),
                           ("linear_fc2.weight", ("hidden_size", "vision_merged_size")),
                           ("linear_fc2.bias", ("hidden_size",)))},
    "visual.deepstack_merger_list.{}.norm.weight": ("vision_merged_size",),
    "visual.deepstack_merger_list.{}.norm.bias": ("vision_merged_size",),
}
# The tables by the names a family entry uses for them (`mergecore.families.registry`, which says which tables a
# model_type's Hub names come from). Families with tables are checked strictly (a name in no table fails); any
# other model type only has the DECODER_SHAPES names it uses checked.
SHAPE_TABLES: dict[str, dict] = {
    "decoder": DECODER_SHAPES, "moe": MOE_SHAPES, "mixtral": MIXTRAL_SHAPES,
    "qwen2_5_vl_vision": QWEN2_5_VL_VISION_SHAPES, "qwen3_vl_vision": QWEN3_VL_VISION_SHAPES,
}

EMBEDDING = "model.embed_tokens.weight"
OUTPUT = "lm_head.weight"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A vision-language model's vision tower (Qwen2/2.5/3-VL `visual.`, LLaVA-style `vision_tower.`): its own groups.
_VISION = re.compile(r"(?:^|\.)(?:visual|vision_tower|vision_model)\.(?:.*?\b(?:blocks|layers|layer)\.(\d+)\.)?")
_PATTERNS = [(re.compile("^" + re.escape(p).replace(r"\{\}", r"(\d+)") + "$"), p) for p in DECODER_SHAPES]


def layer_index(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match[1]) if match else None


def group_of(name: str) -> tuple[tuple[int, int], str]:
    """(sort key, group name): embeddings first, then each decoder layer, then norm and heads, then a
    vision tower (its blocks one group each, the rest one group).

    >>> group_of("model.layers.3.mlp.up_proj.weight")
    ((1, 3), 'layers.3')
    """
    vision = _VISION.search(name)
    if vision:
        return ((3, int(vision[1])), f"visual.blocks.{vision[1]}") if vision[1] else ((3, -1), "visual")
    layer = layer_index(name)
    if layer is not None:
        return (1, layer), f"layers.{layer}"
    if "embed" in name:
        return (0, 0), "embed"
    return (2, 0), "head"


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def shape_rows(*tables: dict) -> dict[str, tuple[re.Pattern, tuple]]:
    """pattern -> (its regex, its shape fields), for `check_shapes`."""
    return {pattern: (_regex(pattern), shape) for table in tables for pattern, shape in table.items()}


_ROWS = shape_rows(DECODER_SHAPES, MOE_SHAPES, MIXTRAL_SHAPES, QWEN2_5_VL_VISION_SHAPES, QWEN3_VL_VISION_SHAPES)
# Hub names of a VLM whose language model / vision tower sit under `model.` (Qwen3-VL) read as the rows' names.
_VLM_PREFIXES = ((re.compile(r"^model\.language_model\."), "model."), (re.compile(r"^model\.visual\."), "visual."))
_VISION_BLOCK = re.compile(r"^visual\.blocks\.(\d+)\.")


def _row_name(name: str) -> str:
    for prefix, replacement in _VLM_PREFIXES:
        name = prefix.sub(replacement, name)
    return name


def text_config(config: dict) -> dict:
    """The language model's fields: a VLM's `text_config` over its top-level ones (transformers 4 kept them there)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def dimensions(config: dict) -> dict[str, int]:
    """The sizes a config implies, under the names the shape tables use.

    >>> dimensions({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2})["kv_size"]
    32
    """
    text = text_config(config)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    dims = {k: text[k] for k in fields if isinstance(text.get(k), int)}
    heads = text.get("num_attention_heads")
    if heads and "hidden_size" in dims:
        head_dim = text.get("head_dim") or dims["hidden_size"] // heads
        dims.update(head_dim=head_dim, q_size=heads * head_dim,
                    kv_size=(text.get("num_key_value_heads") or heads) * head_dim)
    experts = next((text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in text), None)
    if isinstance(experts, int):
        dims["num_experts"] = experts
    labels = config.get("id2label")
    dims["num_labels"] = len(labels) if isinstance(labels, dict) else int(config.get("num_labels", 2))
    vision = config.get("vision_config")
    if isinstance(vision, dict) and isinstance(vision.get("hidden_size"), int):
        hidden = vision["hidden_size"]
        dims.update(vision_hidden_size=hidden, vision_qkv_size=3 * hidden,
                    vision_merged_size=hidden * vision.get("spatial_merge_size", 2) ** 2)
        for key in ("intermediate_size", "in_channels", "temporal_patch_size", "patch_size", "num_position_embeddings"):
            if isinstance(vision.get(key), int):
                dims[key if key != "intermediate_size" else "vision_intermediate_size"] = vision[key]
    return dims


def tied_embeddings(config: dict) -> bool:
    value = config.get("tie_word_embeddings")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("tie_word_embeddings")
    return bool(value)


def check_against_config(shapes: dict[str, tuple[int, ...]], config: dict, where: str, allow_unknown: bool = False) -> None:
    """Every tensor's shape must be what config.json says, and its layers, experts and vision blocks all be
    there; unknown names fail for the registered families with name tables unless `allow_unknown` (names a user's
    --custom-mapping vouches for). `where` names the config file in error messages.

    >>> check_against_config({"model.layers.0.mlp.gate.weight": (4, 8)}, {"model_type": "qwen3_moe",
    ...     "hidden_size": 8, "num_experts": 5, "num_hidden_layers": 1}, "hf/config.json")
    Traceback (most recent call last):
    ...
    mergecore.errors.CheckpointError: tensor model.layers.0.mlp.gate.weight has shape (4, 8) but hf/config.json implies (5, 8) (num_experts, hidden_size); the checkpoint and config.json are from different models (pass --hf_model_path with the right config)
    """
    model_type = config.get("model_type")
    tables = family_tables(config)
    checked = bool(tables) and not allow_unknown
    rows = shape_rows(*(tables or (DECODER_SHAPES,)))
    unknown = check_shapes(shapes, config, where, rows)
    if checked and unknown:
        raise CheckpointError(
            f"tensor {unknown[0]} is not a {model_type} parameter per {where}; the checkpoint and "
            "config.json are from different models (pass --hf_model_path with the right config)"
        )
    # a vision tower's own `layers.N` (SigLIP under `vision_tower.`) are not decoder layers
    layers = {i for name in shapes if (i := layer_index(name)) is not None and not _VISION.search(name)}
    expected = text_config(config).get("num_hidden_layers")
    if layers and isinstance(expected, int) and not exactly(expected, layers):
        raise CheckpointError(
            f"checkpoint has decoder layers {min(layers)}..{max(layers)} ({len(layers)}) but {where} says "
            f"num_hidden_layers={expected}; the checkpoint and config.json are from different models "
            "(pass --hf_model_path with the right config)"
        )
    check_expert_counts(shapes, config, where, where)
    _check_vision(shapes, config, where)


def family_tables(config: dict) -> tuple[dict, ...]:
    """The name tables of config.json's family in the registry (none for an unregistered one); a table name no
    table has is a one-line error naming the known ones."""
    family = family_of(config)
    tables = []
    for table in family.names if family else ():
        if isinstance(table, str) and table not in SHAPE_TABLES:
            raise CheckpointError(f"family {family.model_type!r}: no name table {table!r} (known: "
                                  f"{', '.join(SHAPE_TABLES)}); fix its register_family call")
        tables.append(SHAPE_TABLES[table] if isinstance(table, str) else dict(table))
    return tuple(tables)


def check_shapes(shapes: dict[str, tuple[int, ...]], config: dict, where: str, rows: dict | None = None,
                 origin: dict[str, str] | None = None) -> list[str]:
    """Check each tensor a row of `rows` (pattern -> (regex, shape fields); default: every table) names;
    returns the names no row knows. `origin` adds where a tensor came from to the message (a Megatron key)."""
    dims = dimensions(config)
    unknown = []
    for name, shape in shapes.items():
        row_name = _row_name(name)
        fields = next((fields for regex, fields in (rows or _ROWS).values() if regex.match(row_name)), None)
        if fields is None:
            unknown.append(name)
            continue
        want = tuple(f if isinstance(f, int) else dims.get(f, -1) for f in fields)
        if -1 not in want and want != tuple(shape):
            names = ", ".join(str(f) for f in fields)
            source = f" (from {origin[name]})" if origin and name in origin else ""
            raise CheckpointError(
                f"tensor {name} has shape {tuple(shape)} but {where} implies {want} ({names}){source}; "
                "the checkpoint and config.json are from different models (pass --hf_model_path with the right config)"
            )
    return unknown


_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def check_expert_counts(names, config: dict, folder, where: str) -> None:
    """Every layer that holds experts holds experts 0..num_experts-1 (num_experts / num_local_experts /
    n_routed_experts in config.json)."""
    experts = dimensions(config).get("num_experts")
    if experts is None:
        return
    per_layer: dict[int, set[int]] = {}
    for name in names:
        if match := _EXPERT.search(name):
            per_layer.setdefault(int(match[1]), set()).add(int(match[2]))
    for layer, found in sorted(per_layer.items()):
        if not exactly(experts, found):
            raise CheckpointError(
                f"{folder}: decoder layer {layer} has experts {sorted(found)[:3]}... ({len(found)}) but {where} "
                f"says {experts} experts; expert-parallel pieces are missing or the config is not this model's "
                "(pass --hf_model_path with the right config)"
            )


def _check_vision(shapes, config: dict, where: str) -> None:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return
    blocks = {int(m[1]) for name in shapes if (m := _VISION_BLOCK.match(_row_name(name)))}
    depth, heads, hidden = vision.get("depth"), vision.get("num_heads"), vision.get("hidden_size")
    if blocks and isinstance(depth, int) and not exactly(depth, blocks):
        raise CheckpointError(
            f"checkpoint has vision blocks {min(blocks)}..{max(blocks)} ({len(blocks)}) but {where} says "
            f"vision_config.depth={depth}; the checkpoint and config.json are from different models "
            "(pass --hf_model_path with the right config)"
        )
    if blocks and isinstance(heads, int) and isinstance(hidden, int) and (heads < 1 or hidden % heads):
        raise CheckpointError(
            f"{where} says vision_config.num_heads={heads}, which does not divide the vision tower's hidden size "
            f"{hidden}; the checkpoint and config.json are from different models (pass --hf_model_path with the right config)"
        )
