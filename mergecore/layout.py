"""Hugging Face decoder layouts as data: parameter name patterns and the config fields giving shapes.

Used to prove a checkpoint matches its config.json before anything is written, and to group
tensors by layer. Add a model family by adding a table row, not code.
"""

from __future__ import annotations

import re

from .errors import CheckpointError

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
CHECKED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}

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


def dimensions(config: dict) -> dict[str, int]:
    """The sizes a config implies, under the names DECODER_SHAPES uses."""
    dims = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size") if isinstance(config.get(k), int)}
    heads = config.get("num_attention_heads")
    if heads and "hidden_size" in dims:
        head_dim = config.get("head_dim") or dims["hidden_size"] // heads
        dims.update(head_dim=head_dim, q_size=heads * head_dim,
                    kv_size=(config.get("num_key_value_heads") or heads) * head_dim)
    labels = config.get("id2label")
    dims["num_labels"] = len(labels) if isinstance(labels, dict) else int(config.get("num_labels", 2))
    return dims


def tied_embeddings(config: dict) -> bool:
    value = config.get("tie_word_embeddings")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("tie_word_embeddings")
    return bool(value)


def check_against_config(shapes: dict[str, tuple[int, ...]], config: dict, where: str, allow_unknown: bool = False) -> None:
    """Every tensor's shape must be what config.json says; unknown names fail for known families
    unless `allow_unknown` (names a user's --custom-mapping vouches for).

    `where` names the config file in error messages.
    """
    dims = dimensions(config)
    checked = config.get("model_type") in CHECKED_MODEL_TYPES and not allow_unknown
    for name, shape in shapes.items():
        pattern = next((p for regex, p in _PATTERNS if regex.match(name)), None)
        if pattern is None:
            if checked:
                raise CheckpointError(
                    f"tensor {name} is not a {config.get('model_type')} parameter per {where}; the checkpoint and "
                    "config.json are from different models (pass --hf_model_path with the right config)"
                )
            continue
        want = tuple(dims.get(field, -1) for field in DECODER_SHAPES[pattern])
        if -1 not in want and want != tuple(shape):
            fields = ", ".join(DECODER_SHAPES[pattern])
            raise CheckpointError(
                f"tensor {name} has shape {tuple(shape)} but {where} implies {want} ({fields}); "
                "the checkpoint and config.json are from different models (pass --hf_model_path with the right config)"
            )
    layers = {i for name in shapes if (i := layer_index(name)) is not None}
    expected = config.get("num_hidden_layers")
    if layers and isinstance(expected, int) and layers != set(range(expected)):
        raise CheckpointError(
            f"checkpoint has decoder layers {min(layers)}..{max(layers)} ({len(layers)}) but {where} says "
            f"num_hidden_layers={expected}; the checkpoint and config.json are from different models"
        )
