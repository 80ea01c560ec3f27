"""Save tiny megatron-core GPTModels on CPU with gloo: dist_ckpt (torch_dist) folders and legacy verl rank files.

Run as a script (megatron-core's writers spawn processes: needs the __main__ guard). Importing torch and
megatron-core costs more than a save here, so each mode writes many saves per process:

    python mcore_dist_save.py save_many OUT_ROOT PORT KIND...
        TP=1, one process, every KIND in turn (see KINDS), each from the same fixed seed (a fresh generator per
        kind: a kind's weights do not depend on which kinds come before it). Writes, in
        OUT_ROOT/KIND/global_step_7/actor: dist_ckpt, params.pt (the model's own state dict, the ground truth),
        logits.pt (Megatron's own forward on a fixed prompt) and huggingface/config.json. KINDS: dense
        (Qwen2-like), tied (embeddings shared with the output layer), llama (no qkv bias), qwen3 (q/k
        norms, head_dim 32), moe (Qwen2-MoE-like), quant (dense with hidden 128, ffn 256: quantizable).
    python mcore_dist_save.py reshard LAYOUTS_JSON PORT
        LAYOUTS_JSON: a list of layouts, all of one world size, each {"source", "kind", "keys" (stacked or
        per-layer), "tp", "pp", "vpp", "ep", "etp" (null: the TP size), "dist_role", "legacy_role"}. One spawn
        of W gloo processes (W = TP*PP*DP, DP = EP*ETP/TP when that is more than 1) takes them in turn: each
        builds the `kind` model split TP/PP/VPP (and EP/ETP: expert_model_parallel_size,
        expert_tensor_parallel_size) ways and loads `source`/dist_ckpt (a save_many folder) through
        megatron-core's own resharding load. Each rank then saves it twice, as training at that layout does:
        dist_role/dist_ckpt (megatron-core's dist_checkpointing.save; per-layer keys as heterogeneous models
        write them when asked) and legacy_role/model/mp_rank_TT[_PPP][_EEE]/model.pt (the list of its chunks'
        own `state_dict()`, as verl's legacy checkpoint manager writes it: only on data-parallel rank 0, the
        expert-parallel rank appended when EP > 1). Without PP, rank 0 also writes dist_role/logits.pt from
        the TP- (and expert-) parallel forward. With EP > 1 every rank also writes
        dist_role/experts_rank_R.pt: its own local experts' weights keyed by the global expert index its
        megatron-core MoE layer reports (`local_expert_indices`), the ground truth for expert placement.

Fixture-only patches (docs/facts.md): CPU-only torch needs torch.cuda.synchronize / current_device stubs,
and Tensor.cuda as the identity (tied embeddings under PP move their copy "to the GPU" before syncing it);
the MoE router's gating needs `moe_utils.te_general_gemm` defined (None without TransformerEngine: 0.16.1
leaves the name undefined and its CPU forward fails with NameError).
"""

import json
import os
import shutil
import sys
import warnings

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, PADDED_VOCAB = 4, 64, 4, 2, 128, 300, 384
# kind -> (hidden, heads, query groups, ffn) where it differs from the above. quant: Qwen2-like with every Linear
# dim a multiple of 128 (head_dim 64, q/k/v 128 rows each), as quantized exports need (tests/core/quantize/test_quantize*.py)
SIZES = {"quant": (128, 2, 2, 256)}
TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def _start(rank: int, world: int, port: str) -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings under PP sync their copies "on the GPU"
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 defines it only when TransformerEngine imports
        moe_utils.te_general_gemm = None


def _split(tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """megatron-core's parallel groups for this layout, replacing any earlier layout's."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


KINDS = ("dense", "tied", "moe", "llama", "qwen3", "quant")  # dense: Qwen2-like (GQA, qkv bias, SwiGLU)


def _models(kind: str, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None) -> list:
    """This rank's model chunks (one per virtual stage)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, heads, groups, ffn = SIZES.get(kind, (HIDDEN, HEADS, GROUPS, FFN))
    extra = {"dense": dict(add_qkv_bias=True), "tied": dict(add_qkv_bias=True), "llama": {},
             "quant": dict(add_qkv_bias=True),
             "qwen3": dict(qk_layernorm=True, kv_channels=32),  # head_dim 32 != hidden / heads
             "moe": dict(add_qkv_bias=True, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                         moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)}[kind]
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups, ffn_hidden_size=ffn,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, **extra)
    spec = get_gpt_layer_local_spec(num_experts=extra.get("num_moe_experts"), normalization="RMSNorm",
                                    qk_layernorm=kind == "qwen3")
    chunks = []
    for v in range(vpp):
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        chunks.append(GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=128, pre_process=first,
                               post_process=last, position_embedding_type="rope",
                               share_embeddings_and_output_weights=kind == "tied", vp_stage=v if vpp > 1 else None))
    return chunks


def _forward(model, out: str) -> None:
    """Megatron's own logits for TOKENS (eval: no dropout, so no CUDA RNG is needed)."""
    import contextlib

    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model.eval()
    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.triu(torch.ones(8, 8), diagonal=1).bool()[None, None]  # True = masked (Megatron)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(tokens, positions, attention_mask=causal))
    if torch.distributed.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits[..., :VOCAB].contiguous()}, os.path.join(out, "logits.pt"))


def _hf_config(kind: str) -> dict:
    hidden, heads, groups, ffn = SIZES.get(kind, (HIDDEN, HEADS, GROUPS, FFN))
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": ffn,
          "num_hidden_layers": LAYERS, "num_attention_heads": heads, "num_key_value_heads": groups, "vocab_size": VOCAB,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
    if kind == "tied":
        hf.update(tie_word_embeddings=True)
    if kind == "llama":
        hf.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False)
    if kind == "qwen3":
        hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, attention_bias=False)
    if kind == "moe":
        hf.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True)  # Megatron's router softmaxes the top-k logits only
    return hf


def _save_tp1(out: str, kind: str) -> None:
    import torch
    from megatron.core import dist_checkpointing

    (model,) = _models(kind)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    os.makedirs(os.path.join(out, "dist_ckpt"), exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, os.path.join(out, "dist_ckpt"))
    params = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    torch.save(params, os.path.join(out, "params.pt"))
    _forward(model, out)
    os.makedirs(os.path.join(out, "huggingface"), exist_ok=True)
    with open(os.path.join(out, "huggingface", "config.json"), "w") as f:
        json.dump(_hf_config(kind), f)


def save_many(out_root: str, port: str, *kinds: str) -> None:
    """TP=1 saves of `kinds` into OUT_ROOT/KIND/global_step_7/actor, by this one process.

    e.g. `save_many /tmp/tp1 29500 dense moe` writes /tmp/tp1/dense/global_step_7/actor/dist_ckpt, ...
    """
    import torch.distributed as dist

    _start(0, 1, port)
    _split()
    for kind in kinds:
        _save_tp1(os.path.join(out_root, kind, "global_step_7", "actor"), kind)
    dist.destroy_process_group()


def world_size(tp: int, pp: int, vpp: int, ep: int, etp: int | None) -> int:
    """Ranks needed: the dense grid TP*PP*DP must hold the expert grid ETP*EP (times PP); ETP None is TP."""
    return tp * pp * max(1, ep * (etp or tp) // tp)


def _legacy_folder(legacy_role: str, pp: int, ep: int) -> str | None:
    """verl's legacy manager: data-parallel rank 0 saves, into mp_rank_TT[_PPP] plus _EEE (the expert-parallel
    rank) when EP > 1; other data-parallel ranks save nothing, whatever experts they hold (verl #2086)."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() != 0:
        return None
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if pp > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if ep > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return os.path.join(legacy_role, "model", name)


def _dump_local_experts(chunks: list, dist_role: str) -> None:
    """This rank's experts as megatron-core's own MoE layers place them: {"L.E.fc1"/"L.E.fc2": weight}
    with L the global layer index and E the global expert index of `local_expert_indices`."""
    import torch

    found = {}
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            mlp = layer.mlp
            for local, expert in enumerate(mlp.experts.local_experts):
                where = f"{layer.layer_number - 1}.{mlp.local_expert_indices[local]}"
                found[f"{where}.fc1"] = expert.linear_fc1.weight.detach().clone()
                found[f"{where}.fc2"] = expert.linear_fc2.weight.detach().clone()
    torch.save(found, os.path.join(dist_role, f"experts_rank_{torch.distributed.get_rank()}.pt"))


SIZES_OF_LAYOUT = ("tp", "pp", "vpp", "ep", "etp")


def _reshard_rank(rank: int, port: str, layouts: list[dict]) -> None:
    """Each of `layouts` (see `reshard`: any kinds and key styles, one world size) in turn, in one process
    group: a spawn (megatron-core's import) costs more than a layout."""
    import torch.distributed as dist

    _start(rank, world_size(*(layouts[0][name] for name in SIZES_OF_LAYOUT)), port)
    for layout in layouts:
        _split(*(layout[name] for name in SIZES_OF_LAYOUT))
        _save_layout(**layout)
    dist.destroy_process_group()


def _save_layout(source: str, kind: str, keys: str, tp: int, pp: int, vpp: int, ep: int, etp: int | None,
                 dist_role: str, legacy_role: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    chunks = _models(kind, tp, pp, vpp, ep, etp)
    keyed = {f"model{v}" if vpp > 1 else "model": chunk for v, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load({k: c.sharded_state_dict() for k, c in keyed.items()},
                                     os.path.join(source, "dist_ckpt"))
    for key, chunk in keyed.items():
        chunk.load_state_dict(loaded[key], strict=False)  # _extra_state entries are not in the source
    dist.barrier()
    metadata = {"non_homogeneous_layers": keys == "per-layer"}  # per-layer keys, as heterogeneous models save
    dist_checkpointing.save({k: c.sharded_state_dict(metadata=metadata) for k, c in keyed.items()},
                            os.path.join(dist_role, "dist_ckpt"))
    # verl's legacy checkpoint manager: each saving rank writes its chunks' own state dicts, one list per rank
    folder = _legacy_folder(legacy_role, pp, ep)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        torch.save([chunk.state_dict() for chunk in chunks], os.path.join(folder, "model.pt"))
    if ep > 1:
        _dump_local_experts(chunks, dist_role)
    if pp == 1:
        _forward(chunks[0], dist_role)
    dist.barrier()


def reshard(layouts_json: str, port: str) -> None:
    """The layouts listed in LAYOUTS_JSON (all of one world size), saved by one spawn of that many processes."""
    import torch.multiprocessing as mp

    with open(layouts_json) as f:
        layouts = json.load(f)
    worlds = {world_size(*(layout[name] for name in SIZES_OF_LAYOUT)) for layout in layouts}
    assert len(worlds) == 1, f"layouts of one spawn need one world size, not {worlds}"
    for layout in layouts:
        for role in (layout["dist_role"], layout["legacy_role"]):
            shutil.copytree(os.path.join(layout["source"], "huggingface"), os.path.join(role, "huggingface"),
                            dirs_exist_ok=True)
        os.makedirs(os.path.join(layout["dist_role"], "dist_ckpt"), exist_ok=True)
        os.makedirs(os.path.join(layout["legacy_role"], "model"), exist_ok=True)
    mp.spawn(_reshard_rank, args=(port, layouts), nprocs=worlds.pop(), join=True)


if __name__ == "__main__":
    {"save_many": save_many, "reshard": reshard}[sys.argv[1]](*sys.argv[2:])
