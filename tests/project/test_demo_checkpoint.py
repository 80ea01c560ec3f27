"""Tests of ckptflow.testing.demo_checkpoint: the tiny real verl FSDP checkpoints used as fixtures."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (registers DTensor for torch.load)
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptflow.testing.demo_checkpoint import (
    DemoCheckpoint,
    DemoCheckpointError,
    DemoSpec,
    _run_distributed,
    write_demo_checkpoint,
)

LR = 1e-3  # the demo's AdamW learning rate


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _rank_files(ck: DemoCheckpoint, kind: str, world_size: int) -> list[Path]:
    return [ck.role_dir / f"{kind}_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]


def _model_shards(ck: DemoCheckpoint, world_size: int) -> list[dict]:
    return [_load(p) for p in _rank_files(ck, "model", world_size)]


def _reference(ck: DemoCheckpoint) -> dict[str, torch.Tensor]:
    return load_file(ck.reference_dir / "model.safetensors")


def _shard_dim(t: DTensor) -> int:
    dims = [p.dim for p in t.placements if isinstance(p, Shard)]
    assert len(dims) == 1, t.placements
    return dims[0]


def _assemble(shards: list[dict], key: str, ranks: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the local pieces of one DTensor over ``ranks`` (one shard group)."""
    ranks = list(range(len(shards))) if ranks is None else ranks
    first = shards[ranks[0]][key]
    dim = _shard_dim(first)
    locals_ = [shards[r][key].to_local() for r in ranks]
    return torch.cat(locals_, dim=dim), [t.shape[dim] for t in locals_]


@pytest.fixture(scope="module")
def fsdp2(demo) -> DemoCheckpoint:
    return demo("fsdp2-w2")


@pytest.fixture(scope="module")
def placement_tied(demo) -> DemoCheckpoint:
    return demo("fsdp2-w2-llama-tied-placement")


# --------------------------------------------------------------------------- fsdp2, W=2


def test_fsdp2_layout_and_metadata(fsdp2: DemoCheckpoint):
    assert fsdp2.role_dir == fsdp2.run_root / "global_step_1" / "actor"
    assert fsdp2.reference_dir == fsdp2.run_root / "reference"
    assert (fsdp2.run_root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    for kind in ("model", "optim", "extra_state"):
        for p in _rank_files(fsdp2, kind, 2):
            assert p.is_file(), p
    assert not list(fsdp2.role_dir.glob("*world_size_2_rank_2.pt"))
    assert json.loads((fsdp2.role_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}

    hf = fsdp2.role_dir / "huggingface"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["dtype"] == "bfloat16" and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 1001
    assert (hf / "generation_config.json").is_file()

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = "Merging the shards gives back the model's weights: 1001 rows!\n<|im_start|>user\nÜber 🙂<|im_end|>"
    for folder in (hf, fsdp2.reference_dir):
        tok = AutoTokenizer.from_pretrained(folder)
        assert type(tok).__name__ == "Qwen2Tokenizer"  # what transformers picks for model_type qwen2
        assert 0 < len(tok) <= 1001
        ids = tok(text).input_ids
        assert ids and max(ids) < 1001
        # Qwen2Tokenizer rebuilds its pipeline from vocab + merges; it must agree with tokenizer.json.
        assert ids == Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
        assert tok.decode(ids) == text
        assert tok.eos_token_id == cfg["eos_token_id"]
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert chat.endswith("<|im_start|>assistant\n")

    extra = torch.load(_rank_files(fsdp2, "extra_state", 2)[0], map_location="cpu", weights_only=False)
    assert set(extra) == {"lr_scheduler", "rng"}
    assert {"cpu", "random"} <= set(extra["rng"])
    assert extra["lr_scheduler"]["last_epoch"] == 1


def test_fsdp2_dtensor_shards_reassemble_to_reference(fsdp2: DemoCheckpoint):
    shards = _model_shards(fsdp2, 2)
    ref = _reference(fsdp2)
    assert set(shards[0]) == set(shards[1]) == set(ref)
    assert "model.layers.0.self_attn.q_proj.bias" in ref  # qwen2 has q/k/v biases
    assert not any("_fsdp_wrapped_module" in k or "_orig_mod" in k for k in shards[0])
    for key, ref_t in ref.items():
        for rank, sd in enumerate(shards):
            t = sd[key]
            assert isinstance(t, DTensor), key
            assert t.placements == (Shard(0),), (key, t.placements)
            assert t.device_mesh.mesh_dim_names == ("fsdp",)
            assert t.shape == ref_t.shape and t.dtype == torch.float32
            assert t.to_local().dtype == torch.float32
        full, sizes = _assemble(shards, key)
        assert sum(sizes) == ref_t.shape[0]
        assert torch.equal(full, ref_t), key
    _, sizes = _assemble(shards, "model.embed_tokens.weight")
    assert sizes == [501, 500]  # torch.chunk sizing over 2 ranks

    optim = _load(_rank_files(fsdp2, "optim", 2)[0])
    assert set(optim) == {"state", "param_groups"}
    state = optim["state"][0]
    assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)
    assert float(state["step"]) == 1.0
    assert optim["param_groups"][0]["lr"] == pytest.approx(LR)


def test_reference_is_one_adamw_step_from_the_seeded_init(fsdp2: DemoCheckpoint):
    from transformers import AutoConfig, AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(fsdp2.reference_dir)
    assert type(trained).__name__ == "Qwen2ForCausalLM"
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    config = AutoConfig.from_pretrained(fsdp2.role_dir / "huggingface")
    torch.manual_seed(DemoSpec().seed)
    init = type(trained)(config).to(torch.float32).state_dict()
    for key, value in trained.state_dict().items():
        delta = (value - init[key]).abs().max().item()
        # Adam's first update is about lr * sign(grad) per element (plus a tiny weight decay):
        # every tensor moved, none by more than one step.
        assert 0.5 * LR < delta < 1.1 * LR, (key, delta)


# --------------------------------------------------------------------------- placement fn + tied embeddings


def test_placement_fn_gives_shard1_and_tied_keys(placement_tied: DemoCheckpoint):
    shards = _model_shards(placement_tied, 2)
    ref = _reference(placement_tied)
    sd = shards[0]
    # Tied: the rank files hold both names (sharing storage), HF drops lm_head from the saved reference.
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" in sd
    assert "lm_head.weight" not in ref
    assert torch.equal(sd["lm_head.weight"].to_local(), sd["model.embed_tokens.weight"].to_local())
    assert set(sd) - {"lm_head.weight"} == set(ref)

    placements = {k: v.placements for k, v in sd.items()}
    assert any(p == (Shard(1),) for p in placements.values())
    for key, t in sd.items():
        shape = t.shape
        if shape[0] % 2 == 0:
            expected = Shard(0)
        elif len(shape) > 1 and shape[1] % 2 == 0:
            expected = Shard(1)
        else:
            expected = Shard(0)
        assert t.placements == (expected,), (key, shape, t.placements)
    assert placements["model.embed_tokens.weight"] == (Shard(1),)  # 1001 rows, 64 columns

    for key, ref_t in ref.items():
        full, sizes = _assemble(shards, key)
        assert sum(sizes) == ref_t.shape[_shard_dim(sd[key])]
        assert torch.equal(full, ref_t), key
    lm_head, _ = _assemble(shards, "lm_head.weight")
    assert torch.equal(lm_head, ref["model.embed_tokens.weight"])

    cfg = json.loads((placement_tied.role_dir / "huggingface" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True


# --------------------------------------------------------------------------- hsdp


def test_hsdp_replicate_shard(demo):
    ck = demo("hsdp-2x2")  # DemoSpec(mode="hsdp", world_size=4), written once for the session
    shards = _model_shards(ck, 4)
    ref = _reference(ck)
    assert json.loads((ck.role_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 4}
    some = shards[0]["model.embed_tokens.weight"]
    mesh = some.device_mesh
    assert mesh.mesh_dim_names == ("ddp", "fsdp")
    assert tuple(mesh.shape) == (2, 2)
    groups = mesh.mesh.tolist()  # [[0, 1], [2, 3]]: one fsdp shard group per ddp replica
    for key, ref_t in ref.items():
        for sd in shards:
            assert sd[key].placements == (Replicate(), Shard(0)), key
        replicas = [_assemble(shards, key, ranks=g)[0] for g in groups]
        assert torch.equal(replicas[0], replicas[1]), key
        assert torch.equal(replicas[0], ref_t), key
    assert _assemble(shards, "model.embed_tokens.weight", ranks=groups[0])[1] == [501, 500]


# --------------------------------------------------------------------------- fsdp1 variants


def test_fsdp1_without_mesh_writes_sharded_tensors(demo):
    ck = demo("fsdp1-sharded-tensor-tied")  # DemoSpec(mode="fsdp1", world_size=2, tied embeddings)
    files = _rank_files(ck, "model", 2)
    assert all(p.is_file() and p.stat().st_size > 0 for p in files)
    assert json.loads((ck.role_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 2}
    # ShardedTensor is not on the weights_only allow-list, unlike DTensor files.
    with pytest.raises(pickle.UnpicklingError):
        _load(files[0])
    assert (ck.reference_dir / "model.safetensors").is_file()


def test_critic_with_fsdp1_mesh_writes_dtensors(tmp_path):
    ck = write_demo_checkpoint(tmp_path, DemoSpec(arch="critic", mode="fsdp1_mesh", world_size=2))
    assert ck.role_dir.name == "critic"
    assert json.loads((ck.role_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 2}
    hf = ck.role_dir / "huggingface"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForTokenClassification"] and len(cfg["id2label"]) == 1
    assert not (hf / "generation_config.json").exists()

    shards = _model_shards(ck, 2)
    ref = _reference(ck)
    assert set(shards[0]) == set(ref) and "score.weight" in ref and "lm_head.weight" not in ref
    for key, ref_t in ref.items():
        assert all(sd[key].placements == (Shard(0),) for sd in shards), key
        full, _ = _assemble(shards, key)
        assert torch.equal(full, ref_t), key
    # score.weight has one row: rank 1 holds an empty shard
    assert _assemble(shards, "score.weight")[1] == [1, 0]

    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(ck.reference_dir)
    assert model.config.num_labels == 1


# --------------------------------------------------------------------------- single


def test_single_writes_plain_tensors_deterministically(tmp_path):
    spec = DemoSpec(arch="llama", mode="single", world_size=1)
    a = write_demo_checkpoint(tmp_path / "a", spec)
    b = write_demo_checkpoint(tmp_path / "b", spec)
    sd = _load(a.role_dir / "model_world_size_1_rank_0.pt")
    ref = _reference(a)
    assert set(sd) == set(ref)
    for key, ref_t in ref.items():
        assert type(sd[key]) is torch.Tensor and torch.equal(sd[key], ref_t), key
    for rel in ("reference/model.safetensors", "global_step_1/actor/model_world_size_1_rank_0.pt",
                "global_step_1/actor/huggingface/tokenizer.json"):
        assert (a.run_root / rel).read_bytes() == (b.run_root / rel).read_bytes(), rel
    other = write_demo_checkpoint(tmp_path / "c", replace(spec, seed=1))
    assert not torch.equal(_reference(other)["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec",
    [
        DemoSpec(arch="gpt2"),
        DemoSpec(mode="ddp"),
        DemoSpec(mode="single", world_size=2),
        DemoSpec(mode="hsdp", world_size=2),
        DemoSpec(mode="fsdp1", shard_placement_fn=True),
        DemoSpec(num_attention_heads=4, num_key_value_heads=3),
        DemoSpec(config_dtype="int8"),
    ],
)
def test_invalid_specs_are_rejected(tmp_path, spec):
    with pytest.raises(ValueError):
        write_demo_checkpoint(tmp_path, spec)
    assert not any(tmp_path.iterdir())


def test_existing_checkpoint_is_not_overwritten(fsdp2: DemoCheckpoint):
    with pytest.raises(FileExistsError):
        write_demo_checkpoint(fsdp2.run_root, DemoSpec())


def test_worker_error_reaches_the_parent(tmp_path):
    # No huggingface/config.json in the role folder: every rank fails while loading the config.
    (tmp_path / "role").mkdir()
    (tmp_path / "ref").mkdir()
    with pytest.raises(DemoCheckpointError, match=r"(?s)rank \d failed.*huggingface"):
        _run_distributed(2, [(DemoSpec(), tmp_path / "role", tmp_path / "ref")])
