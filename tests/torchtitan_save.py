"""Checkpoints of torchtitan's own models, written by torchtitan's own `CheckpointManager` (torchtitan 0.3.0).

Run as a script in a process that can import torchtitan (`./dev test` installs it with `--no-deps` into
.venv/torchtitan, from .ci/torchtitan.txt; it needs triton to import), so the test process never imports it:

    PYTHONPATH=.venv/torchtitan python tests/torchtitan_save.py OUT --model llama3

Two gloo ranks build torchtitan's model (Llama 3 with grouped-query attention and Llama 3 RoPE scaling, Qwen 3
with q/k norms, Qwen 3 MoE with grouped experts and a load-balancing bias, or DeepSeek-V3 with latent attention,
a dense first layer and shared experts) at a tiny size (`llama3_tp`: four ranks, torchtitan's own tensor-parallel plan
on a (2, 2) mesh under FSDP2), shard every block and the root with FSDP2 (`fully_shard`, as torchtitan's
`apply_fsdp`), train two AdamW steps and save after each through `CheckpointManager` (step 1 with the optimizer,
learning-rate and training state; the last one model-only, torchtitan's default). Written under OUT:

    run/checkpoint/step-1/, run/checkpoint/step-2/    torchtitan's saves
    reference/   torchtitan's own `StateDictAdapter.to_hf` of the trained model, loaded strictly into the
                 Hugging Face class and `save_pretrained` (config.json, tokenizer files, model.safetensors),
                 plus `logits.pt`: the torchtitan model's own forward on fixed ids
"""

from __future__ import annotations

import argparse
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch

from ckptflow.testing.demo_checkpoint import LOGITS_FILE, _build_tokenizer, _free_port, _save_tokenizer

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 1001, 64, 4, 2, 16, 2
EXPERTS, TOP_K, EXPERT_DIM = 4, 2, 40
MODELS = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "llama3_tp")
TP = "_tp"  # a model name ending so: FSDP2 x tensor parallel on a (2, 2) mesh of four ranks, as torchtitan applies it


def _titan_config(model: str):
    """torchtitan's model config at a tiny size, built with torchtitan's own layer builders."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    init = {"weight": torch.nn.init.ones_}
    linear = {"weight": lambda w: torch.nn.init.trunc_normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
    if model == "llama3":
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

        cls = Llama3Model
        layers = _build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=2 * DIM, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=4096, theta=500000, scaling="llama"))
        norm = RMSNorm.Config(normalized_shape=DIM, param_init=init)
    elif model == "deepseek_v3":  # q through a low-rank pair; sigmoid router over 2 groups of 2 experts
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

        cls = DeepSeekV3Model
        layers = _build_dsv3_layers(
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, mscale=1.0, dense_hidden_dim=2 * DIM,
            moe_hidden_dim=EXPERT_DIM, num_experts=EXPERTS, num_shared_experts=1, router_top_k=TOP_K,
            router_score_func="sigmoid", router_num_expert_groups=2, router_num_limited_groups=1,
            router_route_norm=True, attn_backend="flex", moe_comm_backend="standard",
            non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=8, max_seq_len=4096, theta=10000.0))
        norm = RMSNorm.Config(normalized_shape=DIM, param_init=init)
    else:
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm

        cls = Qwen3Model
        shared = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      attn_backend="flex", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4096, theta=1000000.0))
        if model == "qwen3":
            layers = _build_qwen3_layers(**shared, hidden_dim=2 * DIM)
        else:
            layers = _build_qwen3_moe_layers(**shared, moe_hidden_dim=EXPERT_DIM, num_experts=EXPERTS, top_k=TOP_K,
                                             moe_comm_backend="standard")
        norm = _qwen3_norm(DIM)
    for layer in layers:  # FlexAttention goes through torch.compile; torchtitan's SDPA module runs on CPU as is
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cls.Config(
        dim=DIM, vocab_size=VOCAB, norm=norm, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": torch.nn.init.normal_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=linear))


def _hf_config(model: str):
    """The Hugging Face config of the model torchtitan's adapter converts to, as torchtitan's model computes."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if model == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters=rope, max_position_embeddings=131072)
    if model == "deepseek_v3":  # transformers rotates interleaved pairs too (rope_interleave)
        common.pop("head_dim")
        return DeepseekV3Config(
            **common, moe_intermediate_size=EXPERT_DIM, n_routed_experts=EXPERTS, n_shared_experts=1,
            num_experts_per_tok=TOP_K, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=1.0, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=24, rope_interleave=True, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if model == "qwen3":
        return Qwen3Config(**common, rms_norm_eps=1e-6, rope_parameters=rope)
    # torchtitan's router: softmax over the experts, top-k renormalised (route_norm); every layer an MoE layer
    return Qwen3MoeConfig(**common, rms_norm_eps=1e-6, rope_parameters=rope, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_DIM, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])


def _tensor_parallel(config, world_size: int):
    """torchtitan's ParallelDims for FSDP2 x TP on a (world / 2, 2) CPU mesh, its sharding plan set on `config`."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when no accelerator is found
    set_llama3_sharding_config(config, enable_sp=False)
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world_size // 2, cp=1, tp=2, pp=1, ep=1,
                                      world_size=world_size, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


class _TrainState:
    """torchtitan's trainer saves itself as `train_state` (a Stateful): the step."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def _rank(rank: int, world_size: int, port: int, model_name: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        config = _titan_config(model_name.removesuffix(TP))
        if model_name.endswith(TP):
            mesh = _tensor_parallel(config, world_size)
            with torch.device("meta"):
                model = config.build()
            model.parallelize(mesh)  # torchtitan's own TP plan: q/k/v, w1/w3 by rows, wo/w2 by columns
            mesh = mesh.get_mesh("fsdp")
        else:
            with torch.device("meta"):
                model = config.build()
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
        for block in model.layers.values() if hasattr(model.layers, "values") else model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
            if model_name == "deepseek_v3":  # as torchtitan's load-balancing hook leaves it after some steps:
                for block in model.layers.values():  # the Hub's e_score_correction_bias, used in routing
                    if getattr(block, "moe", None) is not None:
                        block.moe.expert_bias_E.copy_(torch.tensor([0.02, -0.01, 0.03, -0.04]))
        optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=2)
        state = _TrainState()
        manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": state}, sd_adapter=None, base_folder=str(Path(out) / "run"))
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
        for step in (1, 2):
            logits = model(tokens[:, :-1])
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # TP: vocab-sharded
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)).backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            state.step = step
            manager.save(step, last_step=step == 2)
        manager.close()
        # torchtitan's own models are saved through model.state_dict() (its save hooks split the fused wqkv)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:
            _write_reference(model_name.removesuffix(TP), config, full, Path(out) / "reference")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_reference(model_name: str, config, full: dict, reference: Path) -> None:
    if model_name == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as Adapter
    elif model_name == "deepseek_v3":
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as Adapter
    else:
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter
    with torch.device("meta"):
        plain = config.build()
    plain.to_empty(device="cpu")
    with torch.no_grad():
        plain.init_weights()  # the rotary tables are buffers outside the state dict
    plain.load_state_dict(full, strict=True)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4242))
    with torch.no_grad():
        own = {"input_ids": ids, "logits": plain(ids).float()}
    # through a folder, as users hold the adapter's output: transformers loads per-expert tensors into its fused
    # experts on load and writes them per expert again on save
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    converted = Path(tempfile.mkdtemp(prefix="adapter-output-"))
    save_file({k: v.contiguous() for k, v in Adapter(config, None).to_hf(full).items()},
              converted / "model.safetensors", metadata={"format": "pt"})
    _hf_config(model_name).save_pretrained(converted)
    hf, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not any(info.values()), info  # every tensor of the adapter's output loaded, none missing
    hf.save_pretrained(reference)
    shutil.rmtree(converted)
    _save_tokenizer(_build_tokenizer(VOCAB), reference, "llama")
    torch.save(own, reference / LOGITS_FILE)


def write(out: Path, model: str, world_size: int = 2) -> None:
    import torch.multiprocessing as tmp

    tmp.start_processes(_rank, args=(world_size, _free_port(), model, str(out)), nprocs=world_size,
                        start_method="spawn")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=MODELS, default="llama3")
    arguments = parser.parse_args()
    sys.exit(write(arguments.out, arguments.model, 4 if arguments.model.endswith(TP) else 2))
