"""Write a verl FSDP2 checkpoint of a large world size (hundreds or thousands of ranks) in one process.

Real FSDP2 at W=1024 needs 1024 processes. Here torch's fake process group (`FakeStore`, backend
"fake") stands in for them: for each rank in turn the process joins a fake group of `world_size`
ranks as that rank, builds the 1-D `("fsdp",)` device mesh, wraps its `torch.chunk`-sized slice of
every parameter with `DTensor.from_local(..., run_check=False, shape=..., stride=...)` and
`torch.save`s the state dict, so each rank file has the pickled structure of a real FSDP2 one
(DTensor, DeviceMesh with this rank's coordinate, placements, one exact-size storage per shard).
Placements follow verl's placement function: `Shard(1)` where dim 0 is not divisible by the world
size but dim 1 is, else `Shard(0)` (uneven, with empty shards on the last ranks).

The model is a tiny Qwen2 from a seeded init (no training step: the sharding, not the values, is
what is under test); `reference/` is its `save_pretrained`, the independent ground truth.
Only the model files are written (no optimizer or extra-state files: a merge never reads them).

>>> world = write_large_world(tmp / "w256", LargeWorldSpec(world_size=256))   # doctest: +SKIP
>>> sorted(p.name for p in world.role_dir.glob("model_*"))[:1]  # doctest: +SKIP
['model_world_size_256_rank_0.pt']
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LargeWorld", "LargeWorldSpec", "write_large_world"]


@dataclass(frozen=True)
class LargeWorldSpec:
    """The issue's shape: 4 layers, hidden 256 (51 tensors); vocab 16000 makes ~50 MB of fp32."""

    world_size: int = 256
    vocab_size: int = 16000
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0


@dataclass(frozen=True)
class LargeWorld:
    run_root: Path
    role_dir: Path
    reference_dir: Path


def write_large_world(out_dir: str | Path, spec: LargeWorldSpec = LargeWorldSpec()) -> LargeWorld:
    """Write `out_dir/global_step_1/actor` (rank files, `fsdp_config.json`, `huggingface/`) and
    `out_dir/reference`; staged beside the result so a failure leaves nothing half-written."""
    import torch

    from .demo_checkpoint import DemoSpec, _build_tokenizer, _write_hf_dir

    run_root = Path(out_dir).resolve()
    role_dir, reference_dir = run_root / "global_step_1" / "actor", run_root / "reference"
    if role_dir.exists() or reference_dir.exists():
        raise FileExistsError(f"{run_root} already holds a checkpoint")
    run_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".large_world_", dir=run_root))
    try:
        demo_spec = DemoSpec(arch="qwen2", world_size=spec.world_size, vocab_size=spec.vocab_size,
                             hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                             num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                             num_key_value_heads=spec.num_key_value_heads, seed=spec.seed)
        _write_hf_dir(demo_spec, staging / "actor" / "huggingface", _build_tokenizer(spec.vocab_size))
        model = _seeded_model(staging / "actor" / "huggingface", spec.seed)
        model.save_pretrained(staging / "reference")
        with torch.no_grad():
            state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        _save_ranks(state, spec.world_size, staging / "actor")
        (staging / "actor" / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 2, "world_size": spec.world_size}))
        role_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / "actor", role_dir)
        os.replace(staging / "reference", reference_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    (run_root / "latest_checkpointed_iteration.txt").write_text("1")
    return LargeWorld(run_root, role_dir, reference_dir)


def _seeded_model(hf_dir: Path, seed: int):
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(hf_dir)
    return Qwen2ForCausalLM(config).to(torch.float32).eval()


def _verl_placement(shape: tuple[int, ...], world_size: int):
    """verl's FSDP2 shard placement function (as in demo_checkpoint): Shard(1) only when dim 0 does
    not divide by the world size and dim 1 does."""
    from torch.distributed.tensor import Shard

    if shape[0] % world_size and len(shape) > 1 and shape[1] % world_size == 0:
        return Shard(1)
    return Shard(0)


def _chunk(tensor, dim: int, parts: int, index: int):
    """Rank `index`'s piece as `torch.chunk` sizes it (empty past the end), in its own storage."""
    import torch

    length = tensor.shape[dim]
    step = -(-length // parts)
    start = min(step * index, length)
    return tensor.narrow(dim, start, min(step, length - start)).clone(memory_format=torch.contiguous_format)


def _save_ranks(state: dict, world_size: int, role_dir: Path) -> None:
    """One `model_world_size_W_rank_R.pt` per rank, each saved while this process is that rank of a fake group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; write the large world elsewhere")
    placements = {name: _verl_placement(tuple(t.shape), world_size) for name, t in state.items()}
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
            shards = {
                name: DTensor.from_local(_chunk(full, placements[name].dim, world_size, rank), mesh,
                                         [placements[name]], run_check=False, shape=full.shape, stride=full.stride())
                for name, full in state.items()
            }
            torch.save(shards, role_dir / f"model_world_size_{world_size}_rank_{rank}.pt")
        finally:
            dist.destroy_process_group()
