"""Benchmark fusing LoRA against the plain merge of the same checkpoint, in one run.

    python bench/bench_lora.py                 # ~2 GB fp32 (8 layers) and ~1.2 GB (4 layers), W=2
    python bench/bench_lora.py --layers 2 4    # quicker

Each size is written once under bench/_work (kept between runs) as two verl FSDP2 checkpoints holding the
same base weights: `plain` (Hugging Face names) and `lora` (peft's names: `base_model.model.*.base_layer.weight`
plus lora_A/lora_B of r=16 on q/k/v/o_proj, and verl's lora_train_meta.json). Rank files are written the way
FSDP2 saves them (a dict of DTensors, Shard(0) over a 1-D mesh) from one process: torch's fake process group
stands in for each rank in turn, so no training is needed for large sizes. Each merge runs `--repeat` times
(page cache warmed first); medians of wall seconds and peak private (anonymous) memory, and the ratio
lora / plain (target <= 1.3x) and the growth of private memory with size (target: flat).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from measure import median_run

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
WORLD = 2
RANK, ALPHA, TARGETS = 16, 32, ("q_proj", "k_proj", "v_proj", "o_proj")
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)


def hf_config(layers: int):
    from transformers import Qwen2Config

    config = Qwen2Config(**SHAPE, num_hidden_layers=layers, tie_word_embeddings=False, dtype="bfloat16")
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def base_tensors(layers: int):
    """(name, shape) of a Qwen2ForCausalLM, in save order."""
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for n in range(layers):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            yield p + name + ".weight", shape
            if name.endswith(("q_proj", "k_proj", "v_proj")):
                yield p + name + ".bias", shape[:1]
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def lora_names(name: str, shape) -> list[tuple[str, tuple]]:
    """peft's names for one base tensor: itself (as base_layer when adapted) and its factors."""
    module = name.rsplit(".", 1)[0]
    if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS):
        return [("base_model.model." + name, shape)]
    return [(f"base_model.model.{module}.base_layer.weight", shape),
            (f"base_model.model.{module}.lora_A.default.weight", (RANK, shape[1])),
            (f"base_model.model.{module}.lora_B.default.weight", (shape[0], RANK))]


def write_rank_files(role: Path, entries: list[tuple[str, tuple]], seed: int) -> None:
    """What FSDP2 ranks save: each its Shard(0) chunk of every tensor as a DTensor on a mesh of WORLD."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    full = {}
    generator = torch.Generator().manual_seed(seed)
    for name, shape in entries:  # the same values in both checkpoints: the same seed per base name
        full[name] = torch.randn(shape, generator=generator) * 0.02
    role.mkdir(parents=True, exist_ok=True)
    for rank in range(WORLD):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        state = {}
        for name, value in full.items():
            local = torch.chunk(value, WORLD, dim=0)[rank].clone()
            state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=value.shape,
                                             stride=value.stride())
        torch.save(state, role / f"model_world_size_{WORLD}_rank_{rank}.pt")
        dist.destroy_process_group()
    (role / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}) + "\n")


def checkpoints(work: Path, layers: int) -> dict[str, Path]:
    roles = {kind: work / f"lora-bench-{layers}-layers" / kind / "global_step_1" / "actor" for kind in ("plain", "lora")}
    if all((r / f"model_world_size_{WORLD}_rank_{WORLD - 1}.pt").exists() for r in roles.values()):
        return roles
    print(f"writing the {layers}-layer checkpoints (once; kept in {work})...", flush=True)
    base = list(base_tensors(layers))
    write_rank_files(roles["plain"], base, seed=layers)
    write_rank_files(roles["lora"], [e for name, shape in base for e in lora_names(name, shape)], seed=layers)
    for role in roles.values():
        hf_config(layers).save_pretrained(role / "huggingface")
    (roles["lora"] / "lora_train_meta.json").write_text(json.dumps({"r": RANK, "lora_alpha": ALPHA,
                                                                    "task_type": "CAUSAL_LM"}) + "\n")
    return roles


def run(label: str, role: Path, out: Path, repeat: int, extra: list[str]) -> dict:
    argv = [PYTHON, str(HERE / "ckptflow_merge.py"), "merge", "--dtype", "bf16", "--local_dir", str(role),
            "--target_dir", str(out), *extra]
    return median_run(label, argv, out, repeat, f"{role}/model_*.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "_work")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs=2, default=(4, 8), help="a smaller and a larger size")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.work / "lora-out"
    results = {}
    for layers in args.layers:
        roles = checkpoints(args.work, layers)
        size = sum(f.stat().st_size for f in roles["plain"].glob("model_*.pt")) / 1e9
        print(f"\n{layers} layers: {size:.2f} GB of fp32 base weights (W={WORLD}), medians of {args.repeat}")
        results[layers] = {
            "plain": run("plain merge (verified)", roles["plain"], out, args.repeat, []),
            "lora": run("LoRA fused merge (verified)", roles["lora"], out, args.repeat, ["--lora", "fuse"]),
        }
    small, large = args.layers
    print("\nratios (targets from the issue in brackets)")
    for layers in args.layers:
        plain, lora = results[layers]["plain"], results[layers]["lora"]
        print(f"  {layers} layers: LoRA fuse / plain merge {lora['seconds'] / plain['seconds']:.2f}x whole process, "
              f"{lora['work_seconds'] / plain['work_seconds']:.2f}x after imports [<= 1.3x]; private memory "
              f"{lora['anon_mib'] / plain['anon_mib']:.2f}x")
    print(f"  private memory of the LoRA merge, {large} vs {small} layers: "
          f"{results[large]['lora']['anon_mib'] / results[small]['lora']['anon_mib']:.2f}x [flat = 1.0]")
    (args.work / "lora_results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
