"""Checks both Megatron readers (legacy `mp_rank_*` files and dist_ckpt) run on their Hugging Face view.

Plain functions over what a reader has already worked out (the Hugging Face names and shapes it will
write, config.json), so that each reader passes its own folder for the messages:

>>> check_layers(["model.layers.0.mlp.up_proj.weight"], {"num_hidden_layers": 2}, "ckpt/model", "hf/config.json")
Traceback (most recent call last):
...
mergecore.errors.CheckpointError: ckpt/model: holds 1 decoder layers but num_hidden_layers=2 in hf/config.json (layer 1 missing); the checkpoint and config.json are from different models, or a pipeline stage is missing
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..errors import CheckpointError
from ..layout import layer_index
from .base import TensorInfo

__all__ = ["check_layers", "check_moe"]


def check_layers(names: Iterable[str], config: dict, folder, config_file) -> None:
    """Decoder layers 0..num_hidden_layers-1 are all there, each with the same (non-MLP) tensors."""
    by_layer: dict[int, set[str]] = {}
    for name in names:
        layer = layer_index(name)
        if layer is not None:
            by_layer.setdefault(layer, set()).add(re.sub(r"layers\.\d+\.", "layers.{}.", name, count=1))
    expected = config.get("num_hidden_layers")
    if isinstance(expected, int) and set(by_layer) != set(range(expected)):
        absent = sorted(set(range(expected)) - set(by_layer))
        raise CheckpointError(
            f"{folder}: holds {len(by_layer)} decoder layers but num_hidden_layers={expected} in {config_file}"
            + (f" (layer {absent[0]} missing)" if absent else "")
            + "; the checkpoint and config.json are from different models, or a pipeline stage is missing"
        )
    union = set().union(*by_layer.values()) if by_layer else set()
    for layer, layer_names in sorted(by_layer.items()):
        missing = sorted(n for n in union - layer_names if ".mlp." not in n)
        if missing:
            raise CheckpointError(
                f"{folder}: decoder layer {layer} has no {missing[0].replace('{}', str(layer))} (other layers "
                "have it); the file holding that layer is damaged or from another save"
            )


def check_moe(tensors: Mapping[str, TensorInfo], config: dict, folder, config_file) -> None:
    """Expert shapes and counts per config.json (layout.py checks dense families only)."""
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    hidden = config.get("hidden_size")
    if not isinstance(experts, int) or not isinstance(hidden, int):
        return
    moe, shared = config.get("moe_intermediate_size"), config.get("shared_expert_intermediate_size")
    want_by_suffix = {
        r"mlp\.experts\.\d+\.(gate|up)_proj\.weight": (moe, hidden),
        r"mlp\.experts\.\d+\.down_proj\.weight": (hidden, moe),
        r"mlp\.shared_expert\.(gate|up)_proj\.weight": (shared, hidden),
        r"mlp\.shared_expert\.down_proj\.weight": (hidden, shared),
        r"mlp\.shared_expert_gate\.weight": (1, hidden),
        r"mlp\.gate\.weight": (experts, hidden),
    }
    per_layer: dict[int, set[int]] = {}
    for name, info in tensors.items():
        match = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if not match:
            continue
        expert = re.match(r"mlp\.experts\.(\d+)\.", match[2])
        if expert:
            per_layer.setdefault(int(match[1]), set()).add(int(expert[1]))
        for pattern, want in want_by_suffix.items():
            if re.fullmatch(pattern, match[2]) and None not in want and tuple(info.shape) != want:
                raise CheckpointError(
                    f"tensor {name} has shape {info.shape} but {config_file} implies {want} (from {info.layout}); the "
                    "checkpoint and config.json are from different models (pass --hf_model_path with the right config)"
                )
    for layer, found in sorted(per_layer.items()):
        if found != set(range(experts)):
            raise CheckpointError(
                f"{folder}: decoder layer {layer} has experts {sorted(found)[:3]}... ({len(found)}) but {config_file} "
                f"says {experts} experts; expert-parallel pieces are missing or the config is not this model's"
            )
