"""torchtitan's own parameter names -> Hugging Face names, per architecture, as plain data.

torchtitan trains its own model classes (`torchtitan.models.llama3.Llama3Model`, `...qwen3.Qwen3Model`), whose
checkpoints keep torchtitan's names (`tok_embeddings.weight`, `layers.N.attention.qkv_linear.wq.weight`,
`layers.N.feed_forward.w1.weight`). Each table row reads `torchtitan pattern: (hf pattern, rows)`; `{}` is the
layer number. `rows` is None when the saved tensor is the Hub's as it is, `"experts"` for torchtitan's grouped
experts (one `[experts, ...]` tensor per layer; the Hub's pattern takes the expert number second: each expert's slice
along dim 0 is one Hub tensor, as its MoE adapters split them), or a transform kind of
`mergecore.families.transforms` that reorders its rows: torchtitan's Llama 3 pairs neighbouring features in its
rotary embedding (`ComplexRoPE`) where Hugging Face's Llama rotates halves, so q and k rows are permuted per head
(what torchtitan's own `Llama3StateDictAdapter.to_hf` does); its Qwen 3 already rotates halves (`CosSinRoPE`).

The table is chosen by the Hugging Face config's `model_type` (`--hf_model_path`), which must describe the model
that was trained.

An hf pattern of None marks a tensor the Hub's model does not hold (torchtitan's load-balancing `expert_bias_E` of
Qwen 3 MoE, which its adapter drops too): never read.

>>> sorted(TABLES)
['deepseek_v3', 'llama', 'qwen3', 'qwen3_moe']
>>> hub_names({"layers.0.attention.qkv_linear.wk.weight": (32, 64)}, {"model_type": "llama",
...            "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}, "ckpt")
{'model.layers.0.self_attn.k_proj.weight': Saved(key='layers.0.attention.qkv_linear.wk.weight', rows=InterleavedRope(2, 16), expert=None)}
>>> list(hub_names({"layers.1.moe.routed_experts.inner_experts.w2_EDF": (2, 64, 40)}, {"model_type": "qwen3_moe"}, "ckpt"))
['model.layers.1.mlp.experts.0.down_proj.weight', 'model.layers.1.mlp.experts.1.down_proj.weight']
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import CheckpointError
from .megatron_maps import find
from .transforms import Transform, make_transform

T = "layers.{}."
H = "model.layers.{}."

_DECODER = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", None),
    T + "attention.qkv_linear.wv.weight": (H + "self_attn.v_proj.weight", None),
    T + "attention.wv.weight": (H + "self_attn.v_proj.weight", None),  # torchtitan before its qkv_linear module
    T + "attention.wo.weight": (H + "self_attn.o_proj.weight", None),
    T + "feed_forward.w1.weight": (H + "mlp.gate_proj.weight", None),
    T + "feed_forward.w3.weight": (H + "mlp.up_proj.weight", None),
    T + "feed_forward.w2.weight": (H + "mlp.down_proj.weight", None),
    T + "attention_norm.weight": (H + "input_layernorm.weight", None),
    T + "ffn_norm.weight": (H + "post_attention_layernorm.weight", None),
    "norm.weight": ("model.norm.weight", None),
    "lm_head.weight": ("lm_head.weight", None),
}


def _qk(rows_q: str | None, rows_k: str | None) -> dict:
    return {T + f"attention.{at}w{p}.weight": (H + f"self_attn.{p}_proj.weight", rows)
            for p, rows in (("q", rows_q), ("k", rows_k)) for at in ("qkv_linear.", "")}


LLAMA3 = {**_DECODER, **_qk("rope_q", "rope_k")}

QWEN3 = {
    **_DECODER, **_qk(None, None),
    T + "attention.q_norm.weight": (H + "self_attn.q_norm.weight", None),
    T + "attention.k_norm.weight": (H + "self_attn.k_norm.weight", None),
}

_EXPERTS = T + "moe.routed_experts.inner_experts."
_HUB_EXPERT = H + "mlp.experts.{}."
QWEN3_MOE = {
    **QWEN3,
    _EXPERTS + "w1_EFD": (_HUB_EXPERT + "gate_proj.weight", "experts"),
    _EXPERTS + "w3_EFD": (_HUB_EXPERT + "up_proj.weight", "experts"),
    _EXPERTS + "w2_EDF": (_HUB_EXPERT + "down_proj.weight", "experts"),
    T + "moe.router.gate.weight": (H + "mlp.gate.weight", None),
    T + "moe.expert_bias_E": (None, None),
}

# DeepSeek-V3: multi-head latent attention (q through a low-rank pair when q_lora_rank > 0, else one wq), dense first
# layers, then MoE layers with shared experts; its load-balancing bias is the Hub's e_score_correction_bias. Both
# rotate interleaved pairs (transformers' rope_interleave), so no rows move. Multi-token-prediction layers
# (`mtp_layers.N`) have no place in transformers' model and are refused by name.
_GROUPED = {pattern: hub for pattern, hub in QWEN3_MOE.items() if pattern.startswith(_EXPERTS)}
DEEPSEEK_V3 = {
    **{pattern: hub for pattern, hub in _DECODER.items() if "attention.w" not in pattern}, **_GROUPED,
    T + "attention.wq.weight": (H + "self_attn.q_proj.weight", None),
    T + "attention.wq_a.weight": (H + "self_attn.q_a_proj.weight", None),
    T + "attention.q_norm.weight": (H + "self_attn.q_a_layernorm.weight", None),
    T + "attention.wq_b.weight": (H + "self_attn.q_b_proj.weight", None),
    T + "attention.wkv_a.weight": (H + "self_attn.kv_a_proj_with_mqa.weight", None),
    T + "attention.kv_norm.weight": (H + "self_attn.kv_a_layernorm.weight", None),
    T + "attention.wkv_b.weight": (H + "self_attn.kv_b_proj.weight", None),
    T + "attention.wo.weight": (H + "self_attn.o_proj.weight", None),
    T + "moe.router.gate.weight": (H + "mlp.gate.weight", None),
    T + "moe.expert_bias_E": (H + "mlp.gate.e_score_correction_bias", None),
    **{T + f"moe.shared_experts.{w}.weight": (H + f"mlp.shared_experts.{p}.weight", None)
       for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
}

TABLES = {"llama": LLAMA3, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}


class Saved(NamedTuple):
    """Where one Hub tensor is saved: the torchtitan key, the transform placing its rows (None: as saved) and, for
    grouped experts, the expert's index along the key's dim 0."""

    key: str
    rows: Transform | None = None
    expert: int | None = None


def is_torchtitan_naming(keys) -> bool:
    """Whether saved model keys are torchtitan's own names rather than a Hugging Face model's.

    >>> is_torchtitan_naming(["tok_embeddings.weight"]), is_torchtitan_naming(["model.embed_tokens.weight"])
    (True, False)
    """
    return any(key == "tok_embeddings.weight" or key.startswith(T[:-3]) for key in keys)


def hub_names(shapes: dict[str, tuple[int, ...]], config: dict, where: str) -> dict[str, Saved]:
    """Hub name -> where it is saved, for every torchtitan key of `shapes` ({key: saved shape}); a one-line
    CheckpointError (`where` first) names a model type or key no table maps."""
    model_type = config.get("model_type")
    table = TABLES.get(model_type)
    if table is None:
        raise CheckpointError(
            f"{where}: holds torchtitan's own parameter names (tok_embeddings, layers.N.attention...), but the "
            f"config of --hf_model_path is a {model_type!r} model; ckptflow maps torchtitan's "
            f"{' and '.join(TABLES)} models: pass --hf_model_path of the Hugging Face model that was trained")
    names, patterns = {}, {pattern: (hf or "", rows) for pattern, (hf, rows) in table.items()}  # find wants strings
    for key, shape in shapes.items():
        mapped = find(key, patterns)
        if mapped is None:
            raise CheckpointError(
                f"{where}: {key} has no Hugging Face name for torchtitan's {model_type} model; the checkpoint is "
                "of another torchtitan model than --hf_model_path describes: pass the matching config")
        hf, rows = table[mapped.pattern]
        if hf is None:
            continue
        if rows == "experts":
            names.update((hf.format(*mapped.indices, e), Saved(key, expert=e)) for e in range(shape[0]))
        else:
            names[hf.format(*mapped.indices)] = Saved(key, make_transform(rows, config) if rows else None)
    return names
