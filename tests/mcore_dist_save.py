"""Save a tiny megatron-core GPTModel as a dist_ckpt (torch_dist), TP=1, one gloo process, CPU only.

Run as a script (megatron-core's async writer spawns processes: needs the __main__ guard):
`python mcore_dist_save.py OUT_DIR PORT [dense|moe]` (moe: a Qwen2-MoE-like model, SequentialMLP experts,
gated shared expert, QKV bias). Writes OUT_DIR/dist_ckpt, OUT_DIR/params.pt (the model's own
state dict, the ground truth), OUT_DIR/logits.pt (Megatron's own forward on a fixed prompt, when it runs on
CPU) and OUT_DIR/huggingface/config.json (the matching Hugging Face config).
Fixture-only patch (shared/FACTS.md): CPU-only torch needs torch.cuda.synchronize / current_device stubs.
"""

import json
import os
import sys
import warnings


def main(out: str, port: str, kind: str = "dense") -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = port
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    moe = {}
    if kind == "moe":
        moe = dict(add_qkv_bias=True, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                   moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32, **moe)
    spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=384, max_sequence_length=128, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    os.makedirs(os.path.join(out, "dist_ckpt"), exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, os.path.join(out, "dist_ckpt"))
    params = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    torch.save(params, os.path.join(out, "params.pt"))
    try:  # Megatron's own logits for a fixed prompt (None if its forward does not run on this CPU build)
        import contextlib

        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # CPU: no CUDA RNG (eval: no dropout)
        model.eval()
        tokens = torch.arange(1, 17).reshape(2, 8)
        positions = torch.arange(8).expand(2, 8)
        with torch.no_grad():
            causal = torch.triu(torch.ones(8, 8), diagonal=1).bool()[None, None]  # True = masked (Megatron)
            logits = model(tokens, positions, attention_mask=causal)
        torch.save({"tokens": tokens, "logits": logits[..., :300].contiguous()}, os.path.join(out, "logits.pt"))
    except Exception as err:  # noqa: BLE001
        print(f"no megatron forward: {err}", file=sys.stderr)
    os.makedirs(os.path.join(out, "huggingface"), exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
    if kind == "moe":
        hf.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
    with open(os.path.join(out, "huggingface", "config.json"), "w") as f:
        json.dump(hf, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
