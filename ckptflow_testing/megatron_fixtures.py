"""Write legacy verl Megatron checkpoints from Hugging Face models, for tests and demos.

The re-sharder is the merge run backwards: the same mapping tables (`mergecore.families.megatron_maps`)
and the inverse transforms (`Transform.split`) cut every Hugging Face tensor into the pieces each
TP x PP x VPP rank of Megatron-core would hold, and each rank's `model.pt` is written the way verl's
legacy Megatron checkpoint manager wrote it (a list of per-virtual-stage state dicts), or the way
Megatron-LM writes its own (`{"model0": ..., "args": Namespace, ...}`).

Layout written under `out_dir` (the run root)::

    latest_checkpointed_iteration.txt
    global_step_{step}/{actor|critic}/
        model/mp_rank_TT[_PPP]/model.pt
        huggingface/config.json
    reference/                        -> save_pretrained() of the source model (the ground truth)

>>> ckpt = write_megatron_checkpoint(tmp, "qwen2", tp=2, pp=2, vpp=2)  # doctest: +SKIP
>>> merge_checkpoint(str(ckpt.role_dir), out, dtype="keep")          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import io
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from mergecore.families.megatron_maps import L, freeze
from mergecore.families.registry import table_for
from mergecore.families.transforms import Replicated, ReplicatedGatedMLP, make_transform, pad_vocab

__all__ = ["ARCHS", "MegatronFixture", "tiny_model", "reshard", "write_megatron_checkpoint"]

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)

# name -> (transformers config class name, model class name, config overrides)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "critic": ("Qwen2Config", "Qwen2ForTokenClassification", {"num_labels": 1, "tie_word_embeddings": False}),
}


@dataclass
class MegatronFixture:
    run_root: Path
    role_dir: Path
    reference_dir: Path


def tiny_model(arch: str, seed: int = 0):
    """A small seeded transformers model of `arch` (see ARCHS), every parameter perturbed (norms and biases too)."""
    import transformers

    config_cls, model_cls, overrides = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _hf_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


def reshard(state: dict[str, torch.Tensor], config: dict, tp: int, pp: int = 1, vpp: int = 1,
            value_model: bool = False, skip_rows: tuple[str, ...] = (),
            expert_tp: int | None = None) -> dict[tuple[int, int], list[OrderedDict]]:
    """Hugging Face tensors -> `{(tp rank, pp rank): [state dict per virtual stage]}` as Megatron-core holds them.

    Rows of the mapping table are used in order, each HF tensor by the first row that names it
    (`skip_rows`: patterns not to use, to write alternative spellings). `expert_tp=1` writes whole
    MoE experts on every TP rank (expert_tensor_parallel_size=1). A tied output head is
    written on the last stage when PP > 1 (Megatron keeps a copy there).
    """
    layers = int(config["num_hidden_layers"])
    chunks = pp * vpp
    if layers % chunks:
        raise ValueError(f"{layers} layers do not split evenly over PP={pp} x VPP={vpp}")
    per_chunk = layers // chunks
    out = {(t, p): [OrderedDict() for _ in range(vpp)] for p in range(pp) for t in range(tp)}
    claimed: set[str] = set()
    table = table_for(config, value_model=value_model)

    def place(mkey_pattern: str, indices: tuple[int, ...]) -> tuple[int, int, str]:
        if mkey_pattern.startswith(L):
            layer = indices[0]
            position = layer // per_chunk
            p, v = position % pp, position // pp
            return p, v, mkey_pattern.format(layer - position * per_chunk, *indices[1:])
        if mkey_pattern.startswith("embedding."):
            return 0, 0, mkey_pattern.format(*indices)
        return pp - 1, vpp - 1, mkey_pattern.format(*indices)

    for pattern, hf_patterns, kind in freeze(table):
        if pattern in skip_rows:
            continue
        regex = _hf_regex(hf_patterns[0])
        for name in sorted(state, key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)]):
            match = regex.match(name)
            if not match:
                continue
            indices = tuple(int(g) for g in match.groups())
            names = [h.format(*indices) for h in hf_patterns]
            if any(n in claimed or n not in state for n in names):
                continue
            claimed.update(names)
            transform = make_transform(kind, config)
            if expert_tp == 1 and ".mlp.experts." in pattern:
                transform = ReplicatedGatedMLP() if kind == "gated" else Replicated()
            pieces = transform.split(dict(zip(transform.parts, (state[n] for n in names))), tp)
            p, v, key = place(pattern, indices)
            for t in range(tp):
                out[(t, p)][v][key] = pieces[t].clone().contiguous()
            if pattern == "embedding.word_embeddings.weight" and pp > 1 and "lm_head.weight" not in state \
                    and not value_model and config.get("tie_word_embeddings"):
                for t in range(tp):
                    out[(t, pp - 1)][vpp - 1]["output_layer.weight"] = pieces[t].clone().contiguous()
    unplaced = sorted(set(state) - claimed)
    if unplaced:
        raise ValueError(f"no mapping row writes {unplaced[0]} ({len(unplaced)} tensors); add one to the table")
    for t in range(tp):  # Megatron chunks list layers in order; keep the head last, like a real save
        for p in range(pp):
            for v in range(vpp):
                chunk = out[(t, p)][v]
                order = sorted(chunk, key=_megatron_order)
                out[(t, p)][v] = OrderedDict((k, chunk[k]) for k in order)
    return out


def _megatron_order(key: str):
    if key.startswith("embedding."):
        return (0, 0, key)
    match = re.match(r"decoder\.layers\.(\d+)\.", key)
    if match:
        return (1, int(match[1]), key)
    return (2, 0 if key.startswith("decoder.") else 1, key)


def _with_extra_state(chunk: OrderedDict, style: str) -> OrderedDict:
    """Add TransformerEngine's `_extra_state` entries (bytes: skipped by readers)."""
    result = OrderedDict()
    for key, value in chunk.items():
        result[key] = value
        if key.endswith("linear_qkv.weight") or key.endswith("linear_fc2.weight"):
            extra = key[: -len("weight")] + "_extra_state"
            result[extra] = io.BytesIO(b"fp8 meta") if style == "megatron-lm" else torch.empty(0, dtype=torch.uint8)
    return result


def write_reference(out_dir: Path, arch: str, seed: int = 0) -> tuple[Path, dict, dict]:
    """Save a tiny seeded `arch` model as `out_dir/reference`; return the folder, its tensors and config."""
    from safetensors.torch import load_file

    reference = out_dir / "reference"
    tiny_model(arch, seed).save_pretrained(reference)
    state = {}
    for file in sorted(reference.glob("*.safetensors")):
        state.update(load_file(file))
    return reference, state, json.loads((reference / "config.json").read_text())


def write_megatron_checkpoint(
    out_dir: str | Path,
    arch: str,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    step: int = 10,
    role: str | None = None,
    style: str = "list",
    seed: int = 0,
    skip_rows: tuple[str, ...] = (),
    expert_tp: int | None = None,
) -> MegatronFixture:
    """A legacy verl Megatron checkpoint of a tiny `arch` model, plus its `reference/` folder.

    `style`: "list" (verl: `torch.save([state dict per virtual stage])`) or "megatron-lm"
    (`{"model0": ..., "model1": ..., "args": Namespace, "checkpoint_version": 3.0, "iteration": step}`;
    with a single stage `{"model": state dict}`).
    """
    out_dir = Path(out_dir)
    value_model = arch == "critic"
    role = role or ("critic" if value_model else "actor")
    reference, state, config = write_reference(out_dir, arch, seed)

    pieces = reshard(state, config, tp, pp, vpp, value_model=value_model, skip_rows=skip_rows, expert_tp=expert_tp)
    role_dir = out_dir / f"global_step_{step}" / role
    for (t, p), chunks in pieces.items():
        folder = role_dir / "model" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
        folder.mkdir(parents=True, exist_ok=True)
        chunks = [_with_extra_state(c, style) for c in chunks]
        if style == "list":
            payload = chunks
        elif style == "megatron-lm":
            args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                      params_dtype=torch.float32, padded_vocab_size=pad_vocab(config["vocab_size"], tp))
            payload = {"args": args, "checkpoint_version": 3.0, "iteration": step}
            payload.update({"model": chunks[0]} if vpp == 1 else {f"model{v}": c for v, c in enumerate(chunks)})
        else:
            raise ValueError(f"unknown style {style!r}: list or megatron-lm")
        torch.save(payload, folder / "model.pt")
    hf = role_dir / "huggingface"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (reference / "generation_config.json").exists():
        (hf / "generation_config.json").write_bytes((reference / "generation_config.json").read_bytes())
    (out_dir / "latest_checkpointed_iteration.txt").write_text(str(step))
    return MegatronFixture(out_dir, role_dir, reference)

