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

from ...errors import CheckpointError
from ...families.layout import MOE_SHAPES, check_expert_counts, check_shapes, layer_index, shape_rows
from ..base import TensorInfo
from ...numbers.claims import absent

__all__ = ["check_layers", "check_moe"]

MOE_ROWS = shape_rows(MOE_SHAPES)


def check_layers(names: Iterable[str], config: dict, folder, config_file) -> None:
    """Decoder layers 0..num_hidden_layers-1 are all there, each with the same (non-MLP) tensors."""
    by_layer: dict[int, set[str]] = {}
    for name in names:
        layer = layer_index(name)
        if layer is not None:
            by_layer.setdefault(layer, set()).add(re.sub(r"layers\.\d+\.", "layers.{}.", name, count=1))
    expected = config.get("num_hidden_layers")
    # num_hidden_layers is a claim of config.json: compared with the layers present, never enumerated
    missing = absent(expected, by_layer) if isinstance(expected, int) else None
    if missing is not None and (missing.count or any(layer >= expected for layer in by_layer)):
        raise CheckpointError(
            f"{folder}: holds {len(by_layer)} decoder layers but num_hidden_layers={expected} in {config_file}"
            + (f" (layer {missing.lowest[0]} missing)" if missing.lowest else "")
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
    """Expert, router and shared-expert shapes and the expert count of every MoE layer per config.json:
    layout.py's MoE rows and expert check (one place for both readers and the FSDP Hub layout)."""
    check_shapes({name: info.shape for name, info in tensors.items()}, config, str(config_file), MOE_ROWS,
                 origin={name: info.layout for name, info in tensors.items()})
    check_expert_counts(tensors, config, folder, config_file)
