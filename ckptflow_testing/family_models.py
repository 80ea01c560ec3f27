"""Tiny models of the decoder families people train now, for `demo_checkpoint` fixtures (`DemoSpec(arch=...)`
with an arch of `FAMILY_ARCHS`).

Each is built from its transformers config class with hidden size `spec.hidden_size` (<= 128), two decoder
layers (one of each kind where the family mixes them: linear and full attention, sliding and full attention,
dense and MoE), non-square experts, and a vision tower of one block where the family is a VLM. Instead of a
training step every parameter and persistent buffer gets seeded noise (`add_noise`), so no tensor keeps an
init value that a merger could get right by accident (zeros, ones, ±inf clip bounds).

>>> build_config(DemoSpec(arch="deepseek_v3"), tokenizer).architectures  # doctest: +SKIP
['DeepseekV3ForCausalLM']
"""

from __future__ import annotations

from typing import Any

# arch -> (config class, model class) in transformers 5
FAMILY_CLASSES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    # Mixtral made like the others (noise, its own logits), beside demo_checkpoint's trained `mixtral`
    "mixtral_noise": ("MixtralConfig", "MixtralForCausalLM"),
    # a Mamba-2 / attention hybrid: config.json holds a non-finite number (time_step_limit [0, Infinity])
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    # its save transposes the router (`mlp.gate.linear.weight` -> `feed_forward.gate_kernel`): elements reordered
    "ergo": ("ErgoConfig", "ErgoForCausalLM"),
    # DeepSeek-V3 text with a vision tower whose save joins q/k/v into `wqkv` with q and k rows permuted for its
    # rotary embedding (PermuteForRope): elements moved, not sliced
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration"),
    # its save interleaves the experts' gate and up rows (`gate_up_proj` -> `w13_weight`, Interleave along dim 1)
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM"),
    # a protein language model whose save writes legacy names (LayerNorm.gamma / .beta for .weight / .bias)
    "esm": ("EsmConfig", "EsmForMaskedLM"),
}
FAMILY_ARCHS = tuple(FAMILY_CLASSES)

_EXPERTS = 4
_EXPERT_WIDTH = 40  # experts [2 * 40, hidden] / [hidden, 40]: non-square, unlike any dense width
_SHARED_WIDTH = 56
_DENSE_WIDTH = 96


def build_config(spec, tokenizer):
    """The family's tiny config (text fields from `spec`, the tokenizer's special ids)."""
    import transformers

    config_class, model_class = FAMILY_CLASSES[spec.arch]
    config = getattr(transformers, config_class)(**_fields(spec, tokenizer))
    config.architectures = [model_class]
    return config


def model_class(arch: str):
    import transformers

    return getattr(transformers, FAMILY_CLASSES[arch][1])


def text_model(model, arch: str):
    """The module whose forward gives text-only logits: Llama 4's multimodal forward fails on text-only input in
    transformers 5.24 ('MoeCausalLMOutputWithPast' object has no attribute 'image_outputs')."""
    return model.language_model if arch == "llama4" else model


def add_noise(model, seed: int) -> None:
    """Seeded noise on every parameter and persistent buffer (in name order, so every rank adds the same)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 104729 + 17)
    persistent = set(model.state_dict())
    tensors = dict(model.named_parameters())  # tied parameters once
    tensors.update((name, b) for name, b in model.named_buffers() if name in persistent)
    with torch.no_grad():
        for name in sorted(tensors):
            tensor = tensors[name]
            if not tensor.numel():
                continue
            if not tensor.is_floating_point():  # DeepSeek-V4's hash routing table: other experts, same range
                low, high = int(tensor.min()), int(tensor.max())
                tensor.copy_(torch.randint(low, high + 1, tensor.shape, generator=gen, dtype=tensor.dtype))
                continue
            # clip bounds start at ±inf: give them finite values (wide enough not to clip) that noise can change
            tensor.copy_(torch.nan_to_num(tensor, posinf=8.0, neginf=-8.0))
            tensor.add_(0.02 * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))


def _fields(spec, tokenizer) -> dict[str, Any]:
    head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    text: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=2,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=head_dim, max_position_embeddings=128, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=_EXPERT_WIDTH)
    linear_attention = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=12, linear_conv_kernel_dim=4,
                            layer_types=["linear_attention", "full_attention"])
    qwen_vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=spec.hidden_size,
                       num_position_embeddings=16)
    sliding = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    arch, dtype = spec.arch, spec.config_dtype
    if arch == "qwen3_5":  # gated full attention: q_proj is 2 x heads x head_dim
        return dict(text_config={**text, **linear_attention, "intermediate_size": _DENSE_WIDTH},
                    vision_config=qwen_vision, tie_word_embeddings=spec.tie_word_embeddings, dtype=dtype)
    if arch == "qwen3_5_moe":
        return dict(text_config={**text, **linear_attention, **moe, "num_experts": _EXPERTS,
                                 "shared_expert_intermediate_size": _SHARED_WIDTH},
                    vision_config=qwen_vision, tie_word_embeddings=spec.tie_word_embeddings, dtype=dtype)
    if arch == "gemma4":  # tied; full-attention layers with their own head dim and k = v; per-layer inputs; MoE block
        gemma = {**text, **sliding, "tie_word_embeddings": True, "intermediate_size": _DENSE_WIDTH,
                 "global_head_dim": 2 * head_dim, "vocab_size_per_layer_input": spec.vocab_size,
                 "hidden_size_per_layer_input": 16, "attention_k_eq_v": True, "enable_moe_block": True,
                 "num_experts": _EXPERTS, "top_k_experts": 2, "moe_intermediate_size": _EXPERT_WIDTH}
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                      use_clipped_linears=True)  # 0-d clip-bound buffers
        return dict(text_config=gemma, vision_config=vision, audio_config=None, tie_word_embeddings=True, dtype=dtype)
    if arch == "gemma3":  # tied: save_pretrained drops language_model.lm_head.weight
        gemma = {**text, **sliding, "tie_word_embeddings": True, "intermediate_size": _DENSE_WIDTH,
                 "query_pre_attn_scalar": head_dim}
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)
        return dict(text_config=gemma, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=True,
                    dtype=dtype)
    if arch in ("deepseek_v3", "kimi_k25"):  # MLA (value head dim unlike the query's), one dense then one MoE layer
        text.pop("head_dim")  # MLA: the rotary part of a head is qk_rope_head_dim
        deepseek = dict(**text, intermediate_size=_DENSE_WIDTH, **moe, n_routed_experts=_EXPERTS, n_shared_experts=1,
                        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, dtype=dtype)
        if arch == "deepseek_v3":
            return deepseek
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                      pos_emb_height=8, pos_emb_width=8, pos_emb_time=2)
        return dict(text_config={**deepseek, "model_type": "deepseek_v3"}, vision_config=vision,
                    tie_word_embeddings=spec.tie_word_embeddings, dtype=dtype)
    if arch == "deepseek_v4":  # compressed and heavily compressed attention, hash-routed then top-k MoE; the
        # Hub's files name the untied head `head.weight` (in memory `lm_head.weight`)
        text.update(num_key_value_heads=1, head_dim=32)
        return dict(**text, **moe, n_routed_experts=_EXPERTS, n_shared_experts=1, q_lora_rank=48, qk_rope_head_dim=8,
                    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                    mlp_layer_types=["hash_moe", "moe"], compress_rates={"compressed_sparse_attention": 4,
                                                                        "heavily_compressed_attention": 8},
                    hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
                    index_topk=4, num_nextn_predict_layers=0, dtype=dtype)
    if arch == "glm4_moe":  # one dense then one MoE layer
        return dict(**text, intermediate_size=_DENSE_WIDTH, **moe, n_routed_experts=_EXPERTS, n_shared_experts=1,
                    n_group=1, topk_group=1, first_k_dense_replace=1, use_qk_norm=True, dtype=dtype)
    if arch == "gpt_oss":
        return dict(**text, **sliding, intermediate_size=_EXPERT_WIDTH, num_local_experts=_EXPERTS,
                    num_experts_per_tok=2, dtype=dtype)
    if arch == "qwen3_vl_moe":  # one dense (mlp_only) then one MoE layer
        return dict(text_config={**text, **moe, "intermediate_size": _DENSE_WIDTH, "num_experts": _EXPERTS,
                                 "decoder_sparse_step": 1, "mlp_only_layers": [0]},
                    vision_config={**qwen_vision, "deepstack_visual_indexes": [0]},
                    tie_word_embeddings=spec.tie_word_embeddings, dtype=dtype)
    if arch == "llama4":  # one dense then one MoE layer (interleave step 2), chunked attention
        llama = {**text, "intermediate_size": _EXPERT_WIDTH, "intermediate_size_mlp": _DENSE_WIDTH,
                 "num_local_experts": _EXPERTS, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                 "attention_chunk_size": 8}
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        return dict(text_config=llama, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings, dtype=dtype)
    if arch == "olmo3":  # q_norm / k_norm over all heads (not one head's dim); sliding and full attention
        text.pop("head_dim")
        return dict(**text, **sliding, intermediate_size=_DENSE_WIDTH, dtype=dtype)
    if arch == "minimax_m2":  # q_norm / k_norm over all heads; every layer MoE
        return dict(**text, intermediate_size=_EXPERT_WIDTH, num_local_experts=_EXPERTS, num_experts_per_tok=2,
                    dtype=dtype)
    if arch == "bamba":  # layer 0 Mamba-2, layer 1 attention
        text.pop("head_dim")
        return dict(**text, intermediate_size=_DENSE_WIDTH, attn_layer_indices=[1], mamba_n_heads=4,
                    mamba_d_head=2 * spec.hidden_size // 4, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                    dtype=dtype)
    if arch == "ergo":  # one dense then one MoE layer (with shared experts); sliding then full attention
        return dict(**text, **sliding, first_dense_intermediate_size=_DENSE_WIDTH, num_dense_blocks=1,
                    moe_intermediate_size=_EXPERT_WIDTH, shared_intermediate_size=_SHARED_WIDTH, num_experts=_EXPERTS,
                    num_experts_per_tok=2, global_attention_every_n_layers=2, dtype=dtype)
    if arch == "inkling2":  # sliding and full attention with their own heads; every layer MoE. The vocabulary is
        # unpadded: a padded one is saved with zero rows appended to the head (made up, not moved: refused)
        text.update(unpadded_vocab_size=spec.vocab_size, swa_num_attention_heads=spec.num_attention_heads,
                    swa_num_key_value_heads=spec.num_key_value_heads, swa_head_dim=head_dim, sliding_window_size=8,
                    rel_extent=8)
        return dict(**text, moe_intermediate_size=_EXPERT_WIDTH, n_routed_experts=_EXPERTS, num_experts_per_tok=2,
                    dtype=dtype)
    if arch == "esm":  # ESM-2: rotary positions, tied head; its own token ids
        return dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=2,
                    num_attention_heads=spec.num_attention_heads, intermediate_size=_DENSE_WIDTH,
                    max_position_embeddings=128, position_embedding_type="rotary", emb_layer_norm_before=False,
                    token_dropout=True, pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.eos_token_id,
                    tie_word_embeddings=True, dtype=dtype)
    if arch == "mixtral_noise":
        return dict(**text, intermediate_size=_EXPERT_WIDTH, num_local_experts=_EXPERTS, num_experts_per_tok=2,
                    dtype=dtype)
    raise ValueError(f"unknown family arch {arch!r}")
