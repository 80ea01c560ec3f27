"""Write a small but real verl-format FSDP checkpoint for tests and demos.

Long because one spawn of real gloo ranks writes every kind the suite needs in one go (every
FSDP wrapping verl uses, LoRA, critics, and a model per family; the family models' own configs are in
`family_models.py`): starting ranks costs more than the rest, so the writer is one piece.

The checkpoint is produced the way verl's ``FSDPCheckpointManager`` produces one:
a tiny Hugging Face model is built from a seeded init on every rank, wrapped with
FSDP (FSDP2 ``fully_shard`` on a 1-D or 2-D mesh, or FSDP1 with or without a
device mesh), trained for one AdamW step on a fixed random batch, and then every
rank ``torch.save``s its sharded model state dict, its optimizer state dict and an
"extra state" dict (lr scheduler + RNG states).  The processes are real
``torch.distributed`` processes (gloo on CPU, started with the ``spawn`` method).

Layout written under ``out_dir`` (the run root)::

    latest_checkpointed_iteration.txt          -> "{step}"
    global_step_{step}/{actor|critic}/
        model_world_size_{W}_rank_{R}.pt
        optim_world_size_{W}_rank_{R}.pt
        extra_state_world_size_{W}_rank_{R}.pt
        fsdp_config.json                       -> {"FSDP_version": 1|2, "world_size": W}
        huggingface/                           -> config.json, generation_config.json, tokenizer files
    reference/                                 -> save_pretrained() of the full trained model (fp32) + tokenizer

``reference/`` is not part of a verl checkpoint: it is the ground truth a merger's
output can be compared with.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["DemoSpec", "DemoCheckpoint", "DemoCheckpointError", "write_demo_checkpoint", "write_demo_checkpoints"]

from .family_models import FAMILY_ARCHS

ARCHS = ("qwen2", "llama", "critic", "qwen3_moe", "qwen2_moe", "mixtral", "qwen2_5_vl", "qwen3_vl", "gemma3_text",
         "qwen3_next", "sarvam_moe") + FAMILY_ARCHS
MODES = ("fsdp2", "hsdp", "fsdp2_tp", "fsdp1_mesh", "fsdp1", "single")
# How the trained model is saved: as verl's FSDPCheckpointManager does (rank files), or by torch's distributed
# checkpoint (`dcp.save` of `get_model_state_dict`) as a plain folder or in torchtitan's layout (checkpoint/step-N,
# flat keys), or by Accelerate's own `save_state` (pytorch_model_fsdp_0/, keys under `model.`, optimizer_0/, random_states_R.pkl).
SAVES = ("verl", "dcp", "torchtitan", "accelerate")
CONFIG_DTYPES = ("bfloat16", "float16", "float32")

# Special tokens of the tiny tokenizer (ids 0, 1, 2 in this order).
_PAD_TOKEN = "<|endoftext|>"
_BOS_TOKEN = "<|endoftext|>"
_IM_START = "<|im_start|>"
_EOS_TOKEN = "<|im_end|>"
_SPECIAL_TOKENS = [_PAD_TOKEN, _IM_START, _EOS_TOKEN]

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A checkpoint holds the weights of a model at one training step.",
    "Fully sharded data parallel splits every parameter across ranks.",
    "Merging the shards gives back the full tensors of the model.",
    "Hello world! How are you today? I am fine, thank you.",
    "Reinforcement learning from human feedback trains an actor and a critic.",
    "The tokenizer turns text into ids and the model turns ids into logits.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too.",
    "user: what is two plus two? assistant: two plus two is four.",
    "Small models are fast to train, save and load in unit tests.",
]

_LR = 1e-3
_WEIGHT_DECAY = 0.01
_BATCH_SIZE = 2
_SEQ_LEN = 16


class DemoCheckpointError(RuntimeError):
    """A worker process failed while writing the demo checkpoint."""


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "qwen2"
    mode: str = "fsdp2"
    world_size: int = 2
    tie_word_embeddings: bool = False
    shard_placement_fn: bool = False
    vocab_size: int = 1001
    hidden_size: int = 64
    intermediate_size: int = 160
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    config_dtype: str = "bfloat16"
    step: int = 1
    seed: int = 0
    # A parameter that diverged: after the training step, rank 0's shard of it gets a NaN, a +Inf and a
    # -Inf (FSDP2 and single modes), so the checkpoint and the reference both hold them.
    nonfinite_param: str | None = None
    # LoRA as verl trains it: peft wraps the model before FSDP, only the adapters train. `lora_only`
    # saves just the adapter tensors (verl's checkpoint.save_lora_only).
    lora: bool = False
    lora_only: bool = False
    save: str = "verl"


# Hyperparameters of the LoRA fixture; alpha/r = 2 so a wrong alpha changes the model visibly.
LORA_R = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
LOGITS_FILE = "logits.pt"  # in reference/: {"input_ids", "logits"} of the trained model's own forward (LoRA runs)
# (VLM and Gemma runs too; a VLM's file adds "image_inputs" (model kwargs: ids, pixel_values, image_grid_thw,
# mm_token_type_ids) and "image_logits", its forward on text + one image.)


@dataclass(frozen=True)
class DemoCheckpoint:
    run_root: Path
    role_dir: Path
    reference_dir: Path


# --------------------------------------------------------------------------- validation


def _validate(spec: DemoSpec) -> None:
    if spec.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")
    if spec.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {spec.mode!r}")
    if spec.config_dtype not in CONFIG_DTYPES:
        raise ValueError(f"config_dtype must be one of {CONFIG_DTYPES}, got {spec.config_dtype!r}")
    if spec.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {spec.world_size}")
    if spec.mode == "single" and spec.world_size != 1:
        raise ValueError(f"mode 'single' needs world_size=1, got {spec.world_size}")
    if spec.mode == "hsdp" and (spec.world_size < 4 or spec.world_size % 2):
        raise ValueError(
            f"mode 'hsdp' uses a (ddp=2, fsdp=W//2) mesh and needs an even world_size >= 4, got {spec.world_size}"
        )
    if spec.save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {spec.save!r}")
    if spec.mode == "fsdp2_tp" and spec.save == "verl":
        raise ValueError("mode 'fsdp2_tp' is saved by DCP only (save='dcp', 'torchtitan' or 'accelerate')")
    if spec.save != "verl" and (spec.mode not in ("fsdp2", "hsdp", "fsdp2_tp") or spec.lora):
        raise ValueError("DCP saves take modes fsdp2, hsdp and fsdp2_tp, without lora")
    if spec.mode == "fsdp2_tp" and (spec.world_size != 4 or spec.arch not in ("llama", "qwen2")):
        raise ValueError("mode 'fsdp2_tp' uses a (dp=2, tp=2) mesh: world_size 4, arch llama or qwen2")
    if spec.shard_placement_fn and spec.mode not in ("fsdp2", "hsdp"):
        raise ValueError("shard_placement_fn is only meaningful for modes 'fsdp2' and 'hsdp'")
    if spec.nonfinite_param is not None and spec.mode not in ("fsdp2", "single"):
        raise ValueError("nonfinite_param is only supported for modes 'fsdp2' and 'single'")
    if spec.lora_only and not spec.lora:
        raise ValueError("lora_only needs lora=True")
    if spec.arch in _OWN_LOGITS_ARCHS and (spec.mode != "fsdp2" or spec.lora or spec.nonfinite_param):
        raise ValueError(f"arch {spec.arch!r} is supported in mode 'fsdp2' without lora or nonfinite_param")
    if spec.arch in FAMILY_ARCHS and (spec.mode != "fsdp2" or spec.lora or spec.nonfinite_param):
        raise ValueError(f"family arch {spec.arch!r} is supported in mode 'fsdp2' without lora or nonfinite_param")
    if spec.arch in FAMILY_ARCHS and spec.num_hidden_layers != 2:
        raise ValueError(f"family arch {spec.arch!r} has 2 layers (one of each kind), got {spec.num_hidden_layers}")
    if spec.lora and (spec.arch == "critic" or spec.mode not in ("fsdp2", "single")):
        raise ValueError("lora is supported for causal LMs in modes 'fsdp2' and 'single'")
    if spec.step < 0:
        raise ValueError(f"step must be >= 0, got {spec.step}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads"):
        if getattr(spec, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(spec, name)}")
    if spec.vocab_size < 16:
        raise ValueError(f"vocab_size must be >= 16 (room for the tokenizer), got {spec.vocab_size}")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if spec.head_dim is None and spec.hidden_size % spec.num_attention_heads:
        raise ValueError("hidden_size must be divisible by num_attention_heads (or give head_dim)")
    if spec.head_dim is not None and (spec.head_dim < 2 or spec.head_dim % 2):
        raise ValueError(f"head_dim must be an even number >= 2 (rotary embeddings), got {spec.head_dim}")


def _role(spec: DemoSpec) -> str:
    return "critic" if spec.arch == "critic" else "actor"


def _fsdp_version(spec: DemoSpec) -> int:
    # "single" stands for an FSDP1 run whose state dict came out as plain tensors.
    return 2 if spec.mode in ("fsdp2", "hsdp") else 1


# --------------------------------------------------------------------------- HF side (parent)


# Qwen2's pre-tokenizer split pattern (GPT-4 style). transformers 5 loads every "qwen2" folder with
# its own Qwen2Tokenizer, which rebuilds the pipeline from vocab + merges with exactly this pattern,
# NFC normalisation and byte-level encoding: ours is built the same way so both agree token for token.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _build_tokenizer(vocab_size: int):
    """A tiny real byte-level BPE tokenizer (Qwen2 style), deterministic, at most ``vocab_size`` entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target = min(vocab_size, 512)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    byte_alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if target >= len(byte_alphabet) + len(_SPECIAL_TOKENS) + 8:
        # All 256 byte symbols: any text can be encoded.
        trainer = trainers.BpeTrainer(
            vocab_size=target, special_tokens=list(_SPECIAL_TOKENS), initial_alphabet=byte_alphabet,
            show_progress=False,
        )
    else:
        # Too small for every byte: keep the most frequent byte symbols of the corpus (others are dropped).
        # They are chosen here, ties broken by symbol, because the trainer's own cut (limit_alphabet
        # alone) breaks frequency ties differently from run to run.
        counts: Counter[str] = Counter()
        for line in _CORPUS:
            for piece, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(line)):
                counts.update(piece)
        keep = target - len(_SPECIAL_TOKENS)
        alphabet = sorted(sorted(counts), key=lambda ch: -counts[ch])[:keep]
        trainer = trainers.BpeTrainer(
            vocab_size=target, special_tokens=list(_SPECIAL_TOKENS), initial_alphabet=alphabet,
            limit_alphabet=len(alphabet), show_progress=False,
        )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:  # pragma: no cover - guarded above
        raise AssertionError("tokenizer vocabulary larger than the model's")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS_TOKEN,
        eos_token=_EOS_TOKEN,
        pad_token=_PAD_TOKEN,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=128,
        padding_side="left",
    )


def _save_tokenizer(tokenizer, folder: Path, arch: str) -> None:
    tokenizer.save_pretrained(folder)
    # Name the class real checkpoints of this family name (and transformers 4 understands).
    cfg_path = folder / "tokenizer_config.json"
    data = json.loads(cfg_path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast" if arch in ("llama", "gemma3_text") else "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _build_config(spec: DemoSpec, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=128,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=spec.config_dtype,
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.arch in FAMILY_ARCHS:
        from . import family_models

        return family_models.build_config(spec, tokenizer)
    if spec.arch in _IN_MEMORY_LAYOUT_ARCHS:
        return _in_memory_layout_config(spec, common)
    if spec.arch in _OWN_LOGITS_ARCHS:
        return _vlm_or_gemma_config(spec, common, tokenizer)
    if spec.arch == "llama":
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    elif spec.arch == "qwen2":
        config = Qwen2Config(**common)
        config.architectures = ["Qwen2ForCausalLM"]
    else:  # critic: value head on a Qwen2 body, as verl builds it
        config = Qwen2Config(num_labels=1, **common)
        config.architectures = ["Qwen2ForTokenClassification"]
    if spec.head_dim is not None:
        config.head_dim = spec.head_dim
    return config


def _model_class(arch: str):
    if arch in FAMILY_ARCHS:
        from . import family_models

        return family_models.model_class(arch)
    if arch in _IN_MEMORY_LAYOUT_ARCHS:
        return _in_memory_layout_model_class(arch)
    if arch in _OWN_LOGITS_ARCHS:
        return _vlm_or_gemma_model_class(arch)
    if arch == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM
    if arch == "qwen2":
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM
    from transformers import Qwen2ForTokenClassification

    return Qwen2ForTokenClassification


def _write_hf_dir(spec: DemoSpec, hf_dir: Path, tokenizer) -> None:
    config = _build_config(spec, tokenizer)
    config.save_pretrained(hf_dir)
    # transformers 5 writes "dtype"; checkpoints made with transformers 4 carry "torch_dtype".
    # Write both so readers of either generation find the base model's dtype.
    cfg_path = hf_dir / "config.json"
    data = json.loads(cfg_path.read_text())
    data["dtype"] = spec.config_dtype
    data["torch_dtype"] = spec.config_dtype
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if spec.arch != "critic":
        from transformers import GenerationConfig

        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=True,
            temperature=0.7,
            top_p=0.8,
        ).save_pretrained(hf_dir)
    _save_tokenizer(tokenizer, hf_dir, spec.arch)
    if spec.arch in _VLM_ARCHS:
        _write_processor_files(spec.arch, hf_dir)


# Models transformers 5 keeps in memory in another layout than the Hub's files (FSDP saves the in-memory
# one; save_pretrained writes the Hub's): each layer's experts packed into 3-D `mlp.experts.gate_up_proj`
# / `mlp.experts.down_proj`. Hub files: Qwen3-MoE and Qwen2-MoE `mlp.experts.N.{gate,up,down}_proj`
# (Qwen2-MoE adds a shared expert and its sigmoid gate), Mixtral `block_sparse_moe.experts.N.w1/w3/w2`.
# Qwen3-Next has Qwen2-MoE's experts under one linear-attention (gated delta rule) and one full-attention layer,
# whose gated `q_proj` is 2 x heads x head_dim wide.
# Sarvam-MoE (GLM-4-MoE's model under its own config) also fuses q/k/v into one `attention.query_key_value` on
# save: one output joined from three saved tensors (weight and bias).
_IN_MEMORY_LAYOUT_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "sarvam_moe")
_MOE_EXPERTS = 4
# arch -> (config class, model class) in transformers.
_MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM"),
}


def _moe_fields(arch: str, spec: DemoSpec) -> dict:
    expert_size = spec.intermediate_size // 4  # tiny experts keep each fixture as cheap as a dense one
    if arch == "sarvam_moe":  # a dense first layer, then MoE; q/k/v biases joined too
        return dict(n_routed_experts=_MOE_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=expert_size,
                    n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
                    head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads)
    if arch == "mixtral":  # experts are `intermediate_size` wide; no shared expert
        return dict(num_local_experts=_MOE_EXPERTS, num_experts_per_tok=2, intermediate_size=expert_size)
    fields = dict(num_experts=_MOE_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=expert_size,
                  decoder_sparse_step=1)
    if arch in ("qwen2_moe", "qwen3_next"):
        fields["shared_expert_intermediate_size"] = 2 * expert_size
    if arch == "qwen3_next":  # linear attention with its own head count and size (not the full layers')
        head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        fields.update(head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=12, linear_conv_kernel_dim=4,
                      layer_types=["linear_attention", "full_attention"] * (spec.num_hidden_layers // 2)
                      + ["linear_attention"] * (spec.num_hidden_layers % 2))
    return fields


def _in_memory_layout_config(spec: DemoSpec, common: dict):
    import transformers

    config_class, model_class = _MOE_FAMILIES[spec.arch]
    config = getattr(transformers, config_class)(**{**common, **_moe_fields(spec.arch, spec)})
    config.architectures = [model_class]
    return config


def _in_memory_layout_model_class(arch: str):
    import transformers

    return getattr(transformers, _MOE_FAMILIES[arch][1])


# --------------------------------------------------------------------------- vision-language models and Gemma 3

# Qwen2.5-VL / Qwen3-VL: transformers 5 keeps them in memory as `model.language_model.*` / `model.visual.*`
# (the Hub's files: `model.layers.*` / `visual.*`, and Qwen3-VL `model.language_model.*`); their huggingface/
# folder holds processor files beside the tokenizer. Gemma 3 text ships with tied embeddings.
_VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")
_OWN_LOGITS_ARCHS = _VLM_ARCHS + ("gemma3_text", "qwen3_next", "sarvam_moe")  # reference/ keeps the model's own logits
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# A tiny vision tower: 4x4-pixel patches, 2x2 of them merged into one language token, 2 frames per patch.
_PATCH, _MERGE, _TEMPORAL = 4, 2, 2
_IMAGE_GRID = (1, 4, 4)  # (frames / 2, patch rows, patch columns): 16 patches -> 4 image tokens
_VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _add_vision_tokens(tokenizer) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": list(_VISION_TOKENS)})
    tokenizer.chat_template = _VLM_CHAT_TEMPLATE


def _vlm_or_gemma_config(spec: DemoSpec, common: dict, tokenizer):
    from transformers import Gemma3TextConfig, Qwen2_5_VLConfig, Qwen3VLConfig

    head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    if spec.arch == "gemma3_text":
        text = {**common, "tie_word_embeddings": True, "head_dim": head_dim}  # tied as Gemma ships, whatever the spec says
        config = Gemma3TextConfig(**text, query_pre_attn_scalar=head_dim, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"] * (spec.num_hidden_layers // 2)
                                  + ["sliding_attention"] * (spec.num_hidden_layers % 2))
        config.architectures = ["Gemma3ForCausalLM"]
        return config
    dtype, tie = common.pop("dtype"), common.pop("tie_word_embeddings")
    # M-RoPE splits each head's rotary frequencies over (time, height, width).
    half = head_dim // 2
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=_PATCH,
                  spatial_merge_size=_MERGE, temporal_patch_size=_TEMPORAL, out_hidden_size=spec.hidden_size)
    ids = {f"{kind}_token_id": tokenizer.convert_tokens_to_ids(token) for kind, token in
           zip(("vision_start", "vision_end", "image", "video"), _VISION_TOKENS)}
    if spec.arch == "qwen2_5_vl":
        vision.update(window_size=_PATCH * _MERGE * 2, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config={**common, "rope_parameters": rope}, vision_config=vision,
                                  tie_word_embeddings=tie, dtype=dtype, **ids)
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    else:
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config={**common, "head_dim": head_dim, "rope_parameters": {**rope, "mrope_interleaved": True}},
                               vision_config=vision, tie_word_embeddings=tie, dtype=dtype, **ids)
        config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def _vlm_or_gemma_model_class(arch: str):
    import transformers

    return getattr(transformers, {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                  "gemma3_text": "Gemma3ForCausalLM"}[arch])


def _write_processor_files(arch: str, hf_dir: Path) -> None:
    """preprocessor_config.json and video_preprocessor_config.json as the Qwen VL processor classes'
    save_pretrained writes them (those classes need torchvision and Pillow, which the fixture does without;
    the tokenizer's save already wrote chat_template.jinja)."""
    mean, std = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]) if arch == "qwen2_5_vl" \
        else ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    processor = "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen3VLProcessor"
    pixels = {"shortest_edge": (_PATCH * _MERGE) ** 2, "longest_edge": (_PATCH * _MERGE) ** 2 * 16}
    common = dict(do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, image_mean=mean,
                  image_std=std, merge_size=_MERGE, patch_size=_PATCH, processor_class=processor, resample=3,
                  rescale_factor=1 / 255, size=pixels, temporal_patch_size=_TEMPORAL)
    video_class = "Qwen2VLVideoProcessor" if arch == "qwen2_5_vl" else "Qwen3VLVideoProcessor"
    files = {"preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessor"},
             "video_preprocessor_config.json": {**common, "video_processor_type": video_class, "do_sample_frames": False,
                                                "min_frames": 4, "max_frames": 768}}
    for name, data in files.items():
        (hf_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _first_vision_token(config) -> int:
    return min(config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id)


def _image_batch(config, batch_size: int, gen) -> dict:
    """Model inputs for `batch_size` samples of _SEQ_LEN tokens, each showing one random image of _IMAGE_GRID
    patches at the processor's positions: <|vision_start|> <|image_pad|> x tokens <|vision_end|> after one
    text token. `mm_token_type_ids` (1 = image) is what Qwen3-VL's processor returns for M-RoPE."""
    import torch

    frames, rows, cols = _IMAGE_GRID
    image_tokens = frames * rows * cols // _MERGE**2
    ids = torch.randint(0, _first_vision_token(config), (batch_size, _SEQ_LEN), generator=gen)
    ids[:, 1] = config.vision_start_token_id
    ids[:, 2:2 + image_tokens] = config.image_token_id
    ids[:, 2 + image_tokens] = config.vision_end_token_id
    patch_values = 3 * _TEMPORAL * _PATCH * _PATCH
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch_size * frames * rows * cols, patch_values, generator=gen),
        "image_grid_thw": torch.tensor([list(_IMAGE_GRID)] * batch_size),
        "mm_token_type_ids": (ids == config.image_token_id).long(),
    }


# --------------------------------------------------------------------------- training (every rank)


def _placement_fn(fsdp_size: int):
    from torch.distributed.tensor import Shard

    def choose(param) -> Shard:
        if param.dim() == 0 or param.shape[0] % fsdp_size == 0:
            return Shard(0)
        if param.dim() > 1 and param.shape[1] % fsdp_size == 0:
            return Shard(1)
        return Shard(0)

    return choose


def _decoder_layer_class(model):
    return type(model.model.layers[0])


def _lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: B starts random (not zero), so the adapter changes the model for sure.
    return LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                      task_type="CAUSAL_LM", init_lora_weights=False)


def _with_lora(model):
    from peft import get_peft_model

    return get_peft_model(model, _lora_config())


def _wrap_fsdp2(model, spec: DemoSpec, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if spec.mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("ddp", "fsdp"))
        fsdp_size = world_size // 2
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
        fsdp_size = world_size
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if spec.shard_placement_fn:
        kwargs["shard_placement_fn"] = _placement_fn(fsdp_size)
    for unit in _fsdp2_units(model.get_base_model() if spec.lora else model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)  # the root (a PeftModel root when LoRA wraps the model)
    return model


def _wrap_fsdp2_tp(model, world_size: int):
    """FSDP2 over tensor parallelism on a (dp=2, tp=2) mesh, as torchtitan wraps a model: each decoder layer's
    q/k/v and gate/up projections column-parallel, o/down row-parallel (`parallelize_module` on the tp mesh), then
    `fully_shard` on the dp mesh: 2-D DTensors (`_StridedShard` and `Shard` placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for unit in _fsdp2_units(model):
        fully_shard(unit, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _save_dcp(rank: int, spec: DemoSpec, model, optimizer, cls, config, role_dir: Path, reference_dir: Path) -> None:
    """The trained model saved by torch's distributed checkpoint in `spec.save`'s layout, and (rank 0) the
    reference: `save_pretrained` of the same model, gathered."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    state = get_model_state_dict(model)
    if spec.save == "dcp":
        dcp.save(state, checkpoint_id=str(role_dir))
    elif spec.save == "torchtitan":  # an earlier step with the training state, the last one model-only
        earlier = {**state, **{f"optimizer.{k}": v for k, v in
                               _flat(get_optimizer_state_dict(model, optimizer)).items()},
                   "train_state.step": torch.tensor(spec.step - 1 if spec.step else 0)}
        dcp.save(earlier, checkpoint_id=str(role_dir / "checkpoint" / f"step-{max(spec.step - 1, 0)}"))
        dcp.save(state, checkpoint_id=str(role_dir / "checkpoint" / f"step-{spec.step}"))
    else:
        _accelerate_save_state(model, optimizer, role_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        fresh = cls(config).to(torch.float32)
        fresh.load_state_dict(full, strict=True)
        fresh.save_pretrained(reference_dir)


def _accelerate_save_state(model, optimizer, role_dir: Path) -> None:
    """Accelerate's own `Accelerator.save_state` of an FSDP2 model with a sharded state dict, as TRL runs it:
    `pytorch_model_fsdp_0/`, `optimizer_0/`, `random_states_R.pkl`. Accelerate picks FSDP on GPU backends only,
    so on CPU its (shared) state is switched to FSDP after the Accelerator is built, and the model and
    optimizer, already sharded, are handed to it as `prepare` would leave them."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True)  # MULTI_CPU over the ranks' process group: one random_states_R.pkl per rank
    for state in (accelerator.state, PartialState()):  # saving the optimizer reads the shared PartialState's
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator._models.append(model)
    accelerator._optimizers.append(optimizer)
    accelerator.save_state(str(role_dir))


def _flat(state: dict, prefix: str = "") -> dict:
    """A nested state dict as flat dotted keys (torchtitan's optimizer entries)."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _fsdp2_units(hf_model) -> list:
    """The modules verl's `apply_fsdp2` shards one by one before the root, in module order: every module whose
    class is in the model's `_no_split_modules` (decoder layers; a VLM's vision blocks too) and, when the
    embeddings are untied, every `nn.Embedding` (a VLM's vision position table too)."""
    import torch

    wrap = set(hf_model._no_split_modules or ())
    untied = not _tied(hf_model.config)
    return [module for module in hf_model.modules()
            if type(module).__name__ in wrap or (untied and isinstance(module, torch.nn.Embedding))]


def _tied(config) -> bool:
    text_config = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(config, "tie_word_embeddings", None) or getattr(text_config, "tie_word_embeddings", False))


def _wrap_fsdp1(model, spec: DemoSpec, world_size: int):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = dict(
        # FSDP1 refuses to pick CPU by itself ("needs a non-CPU accelerator"); naming it works with gloo.
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({_decoder_layer_class(model)}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        sync_module_states=False,  # every rank starts from the same seeded init
    )
    if spec.mode == "fsdp1_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    return FSDP(model, **kwargs)


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "random": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _diverge(model, name: str) -> None:
    """Rank 0's first three values of parameter `name` become NaN, +Inf, -Inf."""
    import torch

    param = model.get_parameter(name)
    local = param.to_local() if hasattr(param, "to_local") else param
    with torch.no_grad():
        local.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])


def _train_and_save(rank: int, world_size: int, spec: DemoSpec, role_dir: Path, reference_dir: Path) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    hf_dir = role_dir / "huggingface"
    config = AutoConfig.from_pretrained(hf_dir)
    cls = _model_class(spec.arch)

    # Seeded init, identical on every rank; parameters stay fp32 (the config's dtype is only metadata).
    # Python's and numpy's generators are seeded too: their states end up in the extra_state files.
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    try:
        import numpy as np

        np.random.seed(spec.seed)
    except ImportError:  # pragma: no cover
        pass
    model = cls(config).to(torch.float32)
    if spec.arch in FAMILY_ARCHS:
        return _save_family(rank, world_size, spec, model, role_dir, reference_dir)
    if spec.lora:
        model = _with_lora(model)  # before FSDP, as verl does; freezes the base weights
    model.train()

    if spec.mode == "fsdp2_tp":
        # Noise instead of a training step: parameters TP leaves whole (embeddings, norms) would get gradients
        # of their tp rank's share only and drift apart across tp ranks, unlike any real trainer's.
        from .family_models import add_noise

        add_noise(model, spec.seed)
        model = _wrap_fsdp2_tp(model, world_size)
    elif spec.mode in ("fsdp2", "hsdp"):
        model = _wrap_fsdp2(model, spec, world_size)
    elif spec.mode in ("fsdp1", "fsdp1_mesh"):
        model = _wrap_fsdp1(model, spec, world_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, betas=(0.9, 0.999), weight_decay=_WEIGHT_DECAY)
    warmup_steps = 1

    def lr_lambda(current_step: int) -> float:  # constant with (trivial) warmup, like verl's default
        return min(1.0, float(current_step + 1) / warmup_steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    # Data parallel: every rank gets its own fixed batch.
    gen = torch.Generator().manual_seed(spec.seed * 7919 + 1000 + rank)
    if spec.arch in _VLM_ARCHS:  # every sample shows the model an image: the vision tower and merger learn too
        batch = _image_batch(config, _BATCH_SIZE, gen)
        loss = model(**batch, labels=batch["input_ids"]).loss
    elif spec.arch == "critic":
        input_ids = torch.randint(0, spec.vocab_size, (_BATCH_SIZE, _SEQ_LEN), generator=gen)
        target = torch.randn(_BATCH_SIZE, _SEQ_LEN, generator=gen)
        values = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.squeeze(-1)
        loss = F.mse_loss(values.float(), target)
    else:
        input_ids = torch.randint(0, spec.vocab_size, (_BATCH_SIZE, _SEQ_LEN), generator=gen)
        loss = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids).loss
    if spec.mode != "fsdp2_tp":
        loss.backward()  # FSDP reduce-scatters (averages) the gradients across ranks here
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if spec.nonfinite_param is not None and rank == 0:
        _diverge(model, spec.nonfinite_param)
    if spec.lora or spec.arch in _OWN_LOGITS_ARCHS:
        logits = _own_logits(model, spec, config)  # every rank takes part in FSDP's forward
        if rank == 0:
            torch.save(logits, reference_dir / LOGITS_FILE)

    if spec.save != "verl":
        return _save_dcp(rank, spec, model, optimizer, cls, config, role_dir, reference_dir)

    # ---- what verl's FSDPCheckpointManager.save_checkpoint writes, per rank
    suffix = f"world_size_{world_size}_rank_{rank}.pt"
    if spec.mode in ("fsdp1", "fsdp1_mesh"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

        with FSDP.state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=True),
            ShardedOptimStateDictConfig(offload_to_cpu=True),
        ):
            model_sd = model.state_dict()
            optim_sd = optimizer.state_dict()
    else:
        model_sd = model.state_dict()
        optim_sd = optimizer.state_dict()
    if spec.lora_only:
        model_sd = {k: v for k, v in model_sd.items() if ".lora_" in k}
    extra = {"lr_scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(model_sd, role_dir / f"model_{suffix}")
    torch.save(optim_sd, role_dir / f"optim_{suffix}")
    torch.save(extra, role_dir / f"extra_state_{suffix}")
    del model_sd, optim_sd

    # ---- reference: the full trained model, gathered on rank 0
    if spec.mode == "single":
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # FSDP1 + cpu_offload segfaults when the parameters already live on the CPU (the clone in its
        # full-state-dict hook reads freed memory); without offload every rank gets the full dict, which
        # is harmless for a tiny model.
        offload = spec.mode not in ("fsdp1", "fsdp1_mesh")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    if rank == 0:
        fresh = cls(config).to(torch.float32)  # tiny: a real init is cheaper than meta + buffer fix-ups
        if spec.lora:
            _save_lora_references(_with_lora(fresh), full, reference_dir, role_dir)
        else:
            fresh.load_state_dict(full, strict=True)
            fresh.save_pretrained(reference_dir)
        (role_dir / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": _fsdp_version(spec), "world_size": world_size}, indent=4) + "\n"
        )


def _save_family(rank: int, world_size: int, spec: DemoSpec, model, role_dir: Path, reference_dir: Path) -> None:
    """A family model (`family_models`): seeded noise instead of a training step; rank 0 writes the reference
    (save_pretrained, and the model's own logits at this process's one thread) from the unwrapped model, then
    every rank saves its FSDP2 shards as verl does (persistent buffers as plain tensors, a full copy per rank)."""
    import torch

    from . import family_models

    family_models.add_noise(model, spec.seed)
    model.eval()
    if rank == 0:
        gen = torch.Generator().manual_seed(4242)
        ids = torch.randint(0, spec.vocab_size, (1, _SEQ_LEN), generator=gen)
        with torch.no_grad():
            logits = family_models.text_model(model, spec.arch)(input_ids=ids).logits.float().clone()
        own = {"input_ids": ids, "logits": logits, "threads": torch.get_num_threads()}
        torch.save(own, reference_dir / LOGITS_FILE)
        model.save_pretrained(reference_dir)
    model = _wrap_fsdp2(model, spec, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=_WEIGHT_DECAY)
    suffix = f"world_size_{world_size}_rank_{rank}.pt"
    torch.save(model.state_dict(), role_dir / f"model_{suffix}")
    torch.save(optimizer.state_dict(), role_dir / f"optim_{suffix}")
    torch.save({"lr_scheduler": {}, "rng": _rng_state()}, role_dir / f"extra_state_{suffix}")
    if rank == 0:
        fsdp_config = {"FSDP_version": 2, "world_size": world_size}
        (role_dir / "fsdp_config.json").write_text(json.dumps(fsdp_config, indent=4) + "\n")


def _own_logits(model, spec: DemoSpec, config) -> dict:
    """The trained model's own forward on fixed ids (and, for a VLM, on fixed text + image): what a merged
    model (a fused one, base + adapter) must give."""
    import torch

    gen = torch.Generator().manual_seed(4242)
    high = _first_vision_token(config) if spec.arch in _VLM_ARCHS else spec.vocab_size
    ids = torch.randint(0, high, (1, _SEQ_LEN), generator=gen)
    model.eval()
    with torch.no_grad():
        result = {"input_ids": ids, "logits": model(input_ids=ids).logits.float().clone()}
        if spec.arch in _VLM_ARCHS:
            image_inputs = _image_batch(config, 1, gen)
            result.update(image_inputs=image_inputs, image_logits=model(**image_inputs).logits.float().clone())
    model.train()
    return result


def _save_lora_references(peft_model, full: dict, reference_dir: Path, role_dir: Path) -> None:
    """reference/ = merge_and_unload() (the fused model), reference/lora_adapter/ = the PEFT model's
    save_pretrained, reference/base/ = the base model without the adapter; and verl's lora_train_meta.json."""
    import copy

    peft_model.load_state_dict(full, strict=True)
    peft_model.save_pretrained(reference_dir / "lora_adapter")
    copy.deepcopy(peft_model).unload().save_pretrained(reference_dir / "base")
    peft_model.merge_and_unload().save_pretrained(reference_dir)
    meta = {"r": LORA_R, "lora_alpha": LORA_ALPHA, "task_type": "CAUSAL_LM"}
    (role_dir / "lora_train_meta.json").write_text(json.dumps(meta) + "\n")


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[dict, str, str]]) -> None:
    """Entry point of one spawned rank (module level so that spawn can import it): trains and saves each
    job's (spec, role folder, reference folder) in turn, in one process group."""
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash in native code still tells the parent where it happened
    # Deprecation noise of the FSDP1/ShardedTensor APIs we use on purpose (verl uses them too).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
    warnings.filterwarnings("ignore", message=r".*returned a view tensor.*", category=UserWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.fsdp\._shard_utils")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        for spec_dict, role_dir, reference_dir in jobs:
            _train_and_save(rank, world_size, DemoSpec(**spec_dict), Path(role_dir), Path(reference_dir))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_single(spec: DemoSpec, role_dir: Path, reference_dir: Path) -> None:
    """World size 1 without torch.distributed: run in this process, leaving its RNG and threads alone."""
    import torch

    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    py_state = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np = None
    verbosity = hf_logging.get_verbosity()
    progress = hf_logging.is_progress_bar_enabled()
    try:
        torch.set_num_threads(1)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        with torch.random.fork_rng(devices=[]):
            _train_and_save(0, 1, spec, role_dir, reference_dir)
    finally:
        torch.set_num_threads(threads)
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _spawnable_main():
    """Let spawn work when ``__main__`` came from stdin (``python - <<EOF``).

    Spawned children re-run the parent's main module from ``__main__.__file__``; for a script read
    from stdin that is the non-file ``"<stdin>"`` and every child dies with FileNotFoundError.  The
    workers need nothing from ``__main__``, so hide such a bogus path while the children start.
    """
    import multiprocessing.process

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    base = multiprocessing.process.ORIGINAL_DIR or ""
    hide = not (
        main is None
        or path is None
        or getattr(main, "__spec__", None) is not None
        or os.path.exists(os.path.join(base, path))
    )
    if hide:
        del main.__file__
    try:
        yield
    finally:
        if hide:
            main.__file__ = path


def _run_distributed(world_size: int, jobs: list[tuple[DemoSpec, Path, Path]]) -> None:
    # Worth another try: the free port was taken before rank 0 bound it, or a rank died by a signal,
    # as gloo's teardown occasionally aborts a process on a loaded 2-core machine
    # ("terminate called without an active exception"). Every rank rewrites its files on a retry.
    for attempt in range(3):
        try:
            return _run_ranks(world_size, jobs, _free_port())
        except DemoCheckpointError as exc:
            transient = "address already in use" in str(exc).lower() or "signal" in str(exc).lower()
            if attempt == 2 or not transient:
                raise


def _run_ranks(world_size: int, jobs: list[tuple[DemoSpec, Path, Path]], port: int) -> None:
    import torch.multiprocessing as tmp

    with _spawnable_main():
        context = tmp.start_processes(
            _worker,
            args=(world_size, port, [(asdict(spec), str(role), str(ref)) for spec, role, ref in jobs]),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
    try:
        # join() returns False while ranks are still running; when one rank fails it stops the others
        # and raises with that rank's traceback.
        while not context.join():
            pass
    except tmp.ProcessRaisedException as exc:
        raise DemoCheckpointError(f"demo checkpoint rank {exc.error_index} failed:\n{exc}") from None
    except tmp.ProcessExitedException as exc:
        raise DemoCheckpointError(f"demo checkpoint rank {exc.error_index} died: {exc}") from None
    finally:
        # Interrupted (e.g. Ctrl-C) while ranks still run: stop exactly the processes we started.
        for proc in context.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in context.processes:
            proc.join(timeout=10)


# --------------------------------------------------------------------------- public entry point


def write_demo_checkpoint(out_dir: str | Path, spec: DemoSpec = DemoSpec()) -> DemoCheckpoint:
    """Write a tiny real verl FSDP checkpoint (one training step) under ``out_dir``.

    ``out_dir`` becomes the run root.  Raises ``FileExistsError`` when it already holds a
    checkpoint for this step/role or a ``reference`` folder, ``ValueError`` for an invalid
    spec and ``DemoCheckpointError`` (with the worker's traceback) when a rank fails.
    """
    return write_demo_checkpoints({out_dir: spec})[out_dir]


def write_demo_checkpoints(specs: dict) -> dict:
    """`write_demo_checkpoint` for each `{out_dir: spec}`; checkpoints written by the same ranks (FSDP2, the
    same world size) share one start of the rank processes, most of a tiny checkpoint's cost.

    >>> made = write_demo_checkpoints({"ckpts/moe": DemoSpec(arch="qwen3_moe"), "ckpts/vl": DemoSpec(arch="qwen3_vl")})  # doctest: +SKIP
    """
    for spec in specs.values():
        _validate(spec)
    staged: dict = {}
    try:
        for out_dir, spec in specs.items():
            staged[out_dir] = _Staged(out_dir, spec)
        batches: dict[int, list[_Staged]] = {}
        for job in staged.values():
            if job.spec.mode == "single":
                _run_single(job.spec, job.role, job.reference)
            elif job.spec.mode == "fsdp2":
                batches.setdefault(job.spec.world_size, []).append(job)
            else:  # other meshes and FSDP1 wrapping: a process group of their own
                _run_distributed(job.spec.world_size, [job.as_job()])
        for world_size, jobs in batches.items():
            _run_distributed(world_size, [job.as_job() for job in jobs])
        return {out_dir: job.publish() for out_dir, job in staged.items()}
    finally:
        for job in staged.values():
            shutil.rmtree(job.staging, ignore_errors=True)


class _Staged:
    """One checkpoint being built in a staging folder next to its run root, so a failed run leaves nothing
    half-written; `publish` moves it into place."""

    def __init__(self, out_dir: str | Path, spec: DemoSpec):
        self.spec = spec
        self.run_root = Path(out_dir).resolve()
        self.role_dir = self.run_root / f"global_step_{spec.step}" / _role(spec)
        self.reference_dir = self.run_root / "reference"
        for d in (self.role_dir, self.reference_dir):
            if d.exists() and any(d.iterdir()):
                raise FileExistsError(f"{d} already exists and is not empty")
        self.run_root.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=".demo_ckpt_", dir=self.run_root))
        self.role, self.reference = self.staging / "role", self.staging / "reference"
        (self.role / "huggingface").mkdir(parents=True)
        self.reference.mkdir()
        self.tokenizer = _build_tokenizer(spec.vocab_size)
        if spec.arch in _VLM_ARCHS:
            _add_vision_tokens(self.tokenizer)
        _write_hf_dir(spec, self.role / "huggingface", self.tokenizer)

    def as_job(self) -> tuple[DemoSpec, Path, Path]:
        return self.spec, self.role, self.reference

    def publish(self) -> DemoCheckpoint:
        _save_tokenizer(self.tokenizer, self.reference, self.spec.arch)
        if self.spec.save != "verl":  # a DCP save carries no config (--hf_model_path names one); removed only once
            shutil.rmtree(self.role / "huggingface")  # every rank is done: a retried start still reads it
        self.role_dir.parent.mkdir(parents=True, exist_ok=True)
        for src, dst in ((self.role, self.role_dir), (self.reference, self.reference_dir)):
            if dst.exists():
                dst.rmdir()  # empty (checked above)
            os.replace(src, dst)
        (self.run_root / "latest_checkpointed_iteration.txt").write_text(str(self.spec.step))
        return DemoCheckpoint(run_root=self.run_root, role_dir=self.role_dir, reference_dir=self.reference_dir)
