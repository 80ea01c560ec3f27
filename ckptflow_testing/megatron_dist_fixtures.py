"""Write Megatron dist_ckpt (torch_dist) checkpoints from Hugging Face models, for tests and demos.

The tensors are the TP=1 pieces of `ckptflow.testing.megatron_fixtures.reshard` (the inverse transforms),
i.e. Megatron's global tensors; layer tensors are stacked on a leading layer axis (homogeneous
models) or kept under per-layer keys `decoder.layers.<i>.<suffix>` (`stacked=False`), experts on an
expert axis (`decoder.layers.mlp.experts.experts.linear_fc1.weight`: `[L, E, ...]`). They are saved
with plain `torch.distributed.checkpoint.save` in one process, beside TransformerEngine-like
`_extra_state` bytes and an optimizer-like tensor (which readers must never read).

Layouts (`layout`): "verl091" -> `actor/model/dist_ckpt`, `actor/model/huggingface`, `actor/optimizer/`,
`actor/extra/`, `ckpt_contents.json`, `transformer_config.json`; "old" -> `actor/dist_ckpt` +
`actor/huggingface`.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

from .megatron_fixtures import MegatronFixture, reshard, write_reference

__all__ = ["write_dist_checkpoint", "to_dist_state", "OPTIMIZER_KEY"]

OPTIMIZER_KEY = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def to_dist_state(legacy: dict[str, torch.Tensor], layers: int, stacked: bool = True) -> OrderedDict:
    """TP=1 legacy keys -> dist_ckpt keys and global tensors (stacked layer axis, expert axis)."""
    out: OrderedDict = OrderedDict()
    grouped: OrderedDict = OrderedDict()  # suffix -> {layer: {expert or None: tensor}}
    for key, value in legacy.items():
        match = _LAYER.match(key)
        if not match:
            out[key] = value
            continue
        layer, suffix = int(match[1]), match[2]
        expert = _EXPERT.match(suffix)
        if expert:
            suffix, e = f"mlp.experts.experts.{expert[2]}", int(expert[1])
        else:
            e = None
        grouped.setdefault(suffix, {}).setdefault(layer, {})[e] = value
    head = OrderedDict((k, out.pop(k)) for k in list(out) if not k.startswith("embedding."))
    for suffix, by_layer in grouped.items():
        def one(layer_values):
            if None in layer_values:
                return layer_values[None]
            return torch.stack([layer_values[e] for e in sorted(layer_values)])

        if stacked:
            if sorted(by_layer) != list(range(layers)):
                raise ValueError(f"{suffix} is not in every layer: use stacked=False")
            out[f"decoder.layers.{suffix}"] = torch.stack([one(by_layer[i]) for i in range(layers)]).contiguous()
        else:
            for layer in sorted(by_layer):
                out[f"decoder.layers.{layer}.{suffix}"] = one(by_layer[layer]).contiguous()
    out.update(head)
    return out


def _with_extra(state: OrderedDict, layers: int) -> OrderedDict:
    """TransformerEngine extra state, as Megatron's ShardedObjects appear in torch_dist: bytes."""
    result = OrderedDict()
    for key, value in state.items():
        result[key] = value
        if key.endswith(("linear_qkv.weight", "linear_fc2.weight")) and ".experts." not in key:
            base = key[: -len("weight")] + "_extra_state"
            if _LAYER.match(key):
                result[f"{base}/shard_0_1"] = io.BytesIO(b"te fp8 meta")
            else:
                for i in range(layers):
                    result[f"{base}/shard_{i}.0_{layers}.1"] = io.BytesIO(b"te fp8 meta")
    return result


def save_dist(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}))


def write_dist_checkpoint(
    out_dir: str | Path,
    arch: str,
    layout: str = "verl091",
    stacked: bool = True,
    step: int = 10,
    seed: int = 0,
    role: str | None = None,
) -> MegatronFixture:
    """A dist_ckpt checkpoint of a tiny `arch` model (see megatron_fixtures.ARCHS), plus `reference/`."""
    out_dir = Path(out_dir)
    reference, hf_state, config = write_reference(out_dir, arch, seed)
    value_model = arch == "critic"
    role = role or ("critic" if value_model else "actor")
    legacy = reshard(hf_state, config, tp=1, value_model=value_model)[(0, 0)][0]
    layers = int(config["num_hidden_layers"])
    state = _with_extra(to_dist_state(legacy, layers, stacked), layers)
    qkv = next(v for k, v in state.items() if k.endswith("linear_qkv.weight"))
    state[OPTIMIZER_KEY] = torch.full_like(qkv, 7.0)  # optimizer state sharing the files: never read

    role_dir = out_dir / f"global_step_{step}" / role
    if layout == "verl091":
        dist, hf = role_dir / "model" / "dist_ckpt", role_dir / "model" / "huggingface"
        save_dist({"optimizer.param_groups.lr": torch.tensor([1e-5])}, role_dir / "optimizer" / "dist_ckpt")
        (role_dir / "extra").mkdir(parents=True, exist_ok=True)
        (role_dir / "ckpt_contents.json").write_text(json.dumps(["model", "optimizer", "extra", "hf_model"]))
        (role_dir / "transformer_config.json").write_text(json.dumps({"num_layers": layers,
                                                                       "hidden_size": config["hidden_size"]}))
    elif layout == "old":
        dist, hf = role_dir / "dist_ckpt", role_dir / "huggingface"
    else:
        raise ValueError(f"unknown layout {layout!r}: verl091 or old")
    save_dist(state, dist)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=torch.float32)
    torch.save({"iteration": step, "checkpoint_version": 3.0, "args": args}, dist / "common.pt")
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "latest_checkpointed_iteration.txt").write_text(str(step))
    return MegatronFixture(out_dir, role_dir, reference)
