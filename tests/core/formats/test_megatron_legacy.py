"""Legacy verl Megatron checkpoints (`model/mp_rank_TT[_PPP]/model.pt`).

Layout evidence: rank files holding real megatron-core 0.16.1 per-rank state dicts (mcore_real.py), merged
and compared with the TP=1 model's own parameters (independent name table) and Megatron's own logits.
The re-sharder fixtures (ckptflow.testing.megatron_fixtures, our transforms run backwards) only supply
damaged or odd inputs: file variants, renumbered layers, missing ranks, bad shapes.
"""

from __future__ import annotations

from helpers import REPO
import doctest
import json
import shutil
from pathlib import Path

import pytest
from conftest import copy_run
import torch

from ckptflow.testing.megatron_fixtures import MegatronFixture, write_megatron_checkpoint
from mcore_real import (LAYOUTS as REAL_LAYOUTS, PARALLEL, PARALLEL_IDS, assert_logits_match, hf_tensors,
                        needs_megatron, parallel_save, tp1_save)
from mergecore import CheckpointError, VerificationError, compare_with_reference, merge_checkpoint
from mergecore import open_checkpoint, prepare, verify_round_trip
from mergecore.numbers.arrays import dtype_of
from mergecore.formats.megatron.legacy import MegatronLegacyCheckpoint
from weights import load_folder

LAYOUTS = {"tp2": (2, 1, 1), "tp2-pp2": (2, 2, 1), "tp2-pp2-vpp2": (2, 2, 2)}  # re-sharder layouts


@pytest.fixture(scope="session")
def mcore(tmp_path_factory):
    """`mcore(arch, layout, **kw)` -> a MegatronFixture, written once per session."""
    made: dict = {}

    def get(arch: str, layout: str = "tp2-pp2-vpp2", **kwargs) -> MegatronFixture:
        key = (arch, layout, tuple(sorted(kwargs.items())))
        if key not in made:
            tp, pp, vpp = LAYOUTS[layout]
            made[key] = write_megatron_checkpoint(tmp_path_factory.mktemp(f"{arch}-{layout}"), arch, tp, pp, vpp, **kwargs)
        return made[key]

    return get


@pytest.fixture
def mcore_copy(mcore, tmp_path):
    """A private copy that a test may damage."""

    def copy(arch: str, layout: str = "tp2-pp2-vpp2", **kwargs) -> MegatronFixture:
        return copy_run(mcore(arch, layout, **kwargs), tmp_path / "copy")

    return copy


def rank_file(ckpt: MegatronFixture, folder: str) -> Path:
    return ckpt.role_dir / "model" / folder / "model.pt"


def edit_rank_file(path: Path, edit) -> None:
    chunks = torch.load(path, map_location="cpu", weights_only=True)
    edit(chunks)
    torch.save(chunks, path)


def one_line_error(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


# ---- transforms ------------------------------------------------------------------------------

def test_transform_and_check_docstrings():
    import mergecore.formats.megatron.checks
    import mergecore.families.transforms

    assert doctest.testmod(mergecore.families.transforms).failed == 0
    assert doctest.testmod(mergecore.formats.megatron.checks).attempted
    assert doctest.testmod(mergecore.formats.megatron.checks).failed == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_transforms_round_trip_both_ways(tp):
    from mergecore.families.transforms import ColumnParallel, FusedQKV, GatedMLP, Replicated, RowParallel, VocabParallel

    g = torch.Generator().manual_seed(tp)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cases = [
        (ColumnParallel(), {"": rand(8, 3)}),
        (RowParallel(), {"": rand(3, 8)}),
        (Replicated(), {"": rand(5)}),
        (VocabParallel(301), {"": rand(301, 4)}),
        (FusedQKV(8, 4, 2), {"q": rand(16, 6), "k": rand(8, 6), "v": rand(8, 6)}),
        (FusedQKV(8, 4, 2), {"q": rand(16), "k": rand(8), "v": rand(8)}),  # bias
        (GatedMLP(), {"gate": rand(8, 3), "up": rand(8, 3)}),
    ]
    for transform, parts in cases:
        pieces = transform.split(parts, tp)
        assert len(pieces) == tp
        merged = transform.merge(pieces)
        assert merged.keys() == parts.keys()
        assert all(torch.equal(merged[k], parts[k]) for k in parts), transform
        again = transform.split(merged, tp)
        assert all(torch.equal(a, b) for a, b in zip(again, pieces)), transform
        assert tuple(pieces[0].shape) == transform.local_shape({k: tuple(v.shape) for k, v in parts.items()}, tp)


def test_fused_qkv_layout_is_per_query_group():
    from mergecore.families.transforms import FusedQKV

    # 4 heads, 2 groups, head_dim 1: group g holds [q_2g, q_2g+1, k_g, v_g]; TP 2 gives one group per rank.
    parts = {"q": torch.arange(4.0), "k": torch.arange(10.0, 12), "v": torch.arange(20.0, 22)}
    pieces = FusedQKV(4, 2, 1).split(parts, 2)
    assert [p.tolist() for p in pieces] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    assert FusedQKV(4, 2, 1).split(parts, 1)[0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


# ---- merging real megatron-core saves -----------------------------------------------------------

@pytest.fixture
def real_copy(tmp_path_factory, tmp_path):
    """`real_copy(kind, layout)` -> (a private copy of a real legacy role folder, the TP=1 save it came from)."""

    def copy(kind: str, layout: str) -> tuple[Path, Path]:
        keys = next(k for kd, lo, k in PARALLEL if (kd, lo) == (kind, layout))
        _, role = parallel_save(tmp_path_factory, kind, layout, keys)
        shutil.copytree(role.parent.parent, tmp_path / "real")
        return tmp_path / "real" / role.relative_to(role.parent.parent), tp1_save(tmp_path_factory, kind)

    return copy


def assert_merges_to(base: Path, out: Path) -> None:
    merged, expected = load_folder(out), hf_tensors(base)
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


@needs_megatron
@pytest.mark.parametrize("kind,layout,keys", PARALLEL, ids=PARALLEL_IDS)
def test_real_megatron_save_merges_to_the_models_own_parameters(kind, layout, keys, tmp_path_factory, tmp_path):
    base = tp1_save(tmp_path_factory, kind)
    dist_role, role = parallel_save(tmp_path_factory, kind, layout, keys)
    manifest = merge_checkpoint(str(role), tmp_path / "out", dtype="keep")
    assert_merges_to(base, tmp_path / "out")
    tp, pp, vpp = REAL_LAYOUTS[layout]
    assert manifest["source"]["format"] == "verl-megatron-legacy"
    assert (manifest["source"]["tp"], manifest["source"]["pp"], manifest["source"]["vpp"]) == (tp, pp, vpp)
    check = manifest["verification"][0]
    assert check["ok"] and check["pieces"] == tp * check["tensors"]
    if kind == "tied":  # PP > 1: the last stage's copy of the embedding is read, checked, not written
        assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    # Megatron's own forward: the TP=1 model that was saved, and the TP=2 one without PP
    assert_logits_match(tmp_path / "out", base / "logits.pt")
    if pp == 1:
        assert_logits_match(tmp_path / "out", dist_role / "logits.pt")


@needs_megatron
def test_bf16_output_is_the_cast_model(tmp_path_factory, tmp_path):
    _, role = parallel_save(tmp_path_factory, "dense", "tp2-pp2-vpp2", "stacked")
    manifest = merge_checkpoint(str(role), tmp_path / "out", dtype="bf16")
    assert manifest["dtype"] == "bfloat16"
    ours, expected = load_folder(tmp_path / "out"), hf_tensors(tp1_save(tmp_path_factory, "dense"))
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor.to(torch.bfloat16)), name


@needs_megatron
def test_huggingface_folder_under_model_is_found(real_copy, tmp_path):
    role, base = real_copy("dense", "tp2")
    (role / "huggingface").rename(role / "model" / "huggingface")
    source = open_checkpoint(str(role.parent.parent))
    assert source.hf_dir.url.endswith("actor/model/huggingface")
    merge_checkpoint(str(role), tmp_path / "out", dtype="keep")
    assert_merges_to(base, tmp_path / "out")


@needs_megatron
def test_globally_numbered_layers_are_accepted(real_copy, tmp_path):
    """Some savers renumber layers globally; the reader takes either numbering."""
    import re

    role, base = real_copy("dense", "tp2-pp2-vpp2")  # one layer per chunk: stage p, chunk v holds layer 2v + p

    def renumber(chunks, pp_rank):
        for v, chunk in enumerate(chunks):
            chunks[v] = {re.sub(r"^decoder\.layers\.0\.", f"decoder.layers.{2 * v + pp_rank}.", k): t
                         for k, t in chunk.items()}

    for folder in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        path = role / "model" / folder / "model.pt"
        chunks = torch.load(path, map_location="cpu", weights_only=True)
        renumber(chunks, int(folder[-1]))
        torch.save(chunks, path)
    merge_checkpoint(str(role), tmp_path / "out", dtype="keep")
    assert_merges_to(base, tmp_path / "out")


# ---- odd files (re-sharder fixtures) -------------------------------------------------------------

def test_megatron_lm_files_and_grouped_experts(mcore, tmp_path):
    """`{"model0": ..., "args": Namespace}` files with BytesIO extra state, TEGroupedMLP expert names."""
    grouped = ("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight",
               "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight")
    ckpt = mcore("qwen3_moe", "tp2-pp2-vpp2", style="megatron-lm", skip_rows=grouped)
    path = rank_file(ckpt, "mp_rank_01_001")
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # Namespace and BytesIO: only the restricted unpickler reads it
    source = open_checkpoint(str(ckpt.role_dir))
    assert source.tensors()["model.layers.3.mlp.experts.2.up_proj.weight"].layout.endswith("linear_fc1.weight2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0


def test_whole_experts_on_every_tp_rank(mcore, tmp_path):
    """expert_tensor_parallel_size=1 under TP 2: experts are replicated, not concatenated."""
    ckpt = mcore("qwen2_moe", "tp2-pp2", expert_tp=1)
    source = open_checkpoint(str(ckpt.role_dir))
    assert source.tensors()["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (32, 64)
    assert source.tensors()["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 32)
    manifest = merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    assert manifest["verification"][0]["ok"]


def test_expert_shape_must_match_the_config(mcore_copy):
    ckpt = mcore_copy("qwen3_moe", "tp2")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "moe_intermediate_size": 48}))
    with pytest.raises(CheckpointError, match=r"mlp.experts.0.gate_proj.weight has shape \(32, 64\) .* implies \(48, 64\)") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "moe_intermediate_size": 32,
                                       "num_local_experts": 5}))
    with pytest.raises(CheckpointError, match=r"mlp.gate.weight has shape \(4, 64\) .* implies \(5, 64\)"):
        prepare(str(ckpt.role_dir))


def test_names_shapes_and_order(mcore):
    source = open_checkpoint(str(mcore("qwen3", "tp2-pp2-vpp2").run_root), backend="megatron")
    infos = source.tensors()
    names = list(infos)
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert infos["model.embed_tokens.weight"].shape == (300, 64)  # vocab padding (512 rows) trimmed
    assert infos["model.layers.3.self_attn.q_proj.weight"].shape == (128, 64)  # explicit head_dim 32
    assert infos["model.layers.3.self_attn.k_proj.weight"].shape == (64, 64)
    assert infos["model.layers.2.self_attn.q_norm.weight"].shape == (32,)
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers) and set(layers) == {0, 1, 2, 3}
    assert source.describe()["layers_per_chunk"] == [1, 1, 1, 1]


def test_input_files_are_the_stage_holding_the_tensors(mcore):
    ckpt = mcore("llama-tied", "tp2-pp2-vpp2")
    source = open_checkpoint(str(ckpt.role_dir))
    files = lambda names: sorted(Path(str(f)).parent.name for f in source.input_files(names))  # noqa: E731
    # VPP 2 x PP 2, one layer per chunk: layers 0, 2 on pp rank 0; layers 1, 3 on pp rank 1
    assert files(["model.layers.2.mlp.up_proj.weight"]) == ["mp_rank_00_000", "mp_rank_01_000"]
    assert files(["model.layers.1.self_attn.q_proj.weight"]) == ["mp_rank_00_001", "mp_rank_01_001"]
    assert files(["model.embed_tokens.weight", "lm_head.weight"]) == sorted(
        ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"])
    assert len(source.input_files()) == 4


def test_group_cache_keys_follow_the_pipeline_stage(mcore_copy, tmp_path):
    """Touching a last-stage file invalidates only the groups that stage holds."""
    import os

    from mergecore.engine.fingerprints import unit_key

    ckpt = mcore_copy("qwen2", "tp2-pp2")  # layers 0, 1 on pp rank 0; layers 2, 3, norm, lm_head on pp rank 1

    def keys():
        prepared = prepare(str(ckpt.role_dir))
        return {g: unit_key(prepared.source, prepared.plan, g, tmp_path) for g in prepared.plan.groups}

    before = keys()
    path = rank_file(ckpt, "mp_rank_01_001")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = keys()
    assert {g for g in before if before[g] != after[g]} == {"layers.2", "layers.3", "head"}


def test_read_touches_one_layer_and_casts(mcore):
    source = open_checkpoint(str(mcore("qwen2", "tp2").role_dir))
    q = source.read("model.layers.1.self_attn.q_proj.bias", "bfloat16")
    assert dtype_of(q) == "bfloat16" and q.shape == (64,)
    pieces = list(source.pieces("model.layers.1.self_attn.k_proj.weight"))
    assert [p.offsets for p in pieces] == [(0, 0), (16, 0)] and all(p.sizes == (16, 64) for p in pieces)
    embed = list(source.pieces("model.embed_tokens.weight"))
    assert [p.sizes[0] for p in embed] == [256, 44]  # 512 padded rows over 2 ranks, trimmed to 300


# ---- verification ----------------------------------------------------------------------------

def test_check_round_trip_catches_a_tampered_piece(mcore_copy, tmp_path):
    ckpt = mcore_copy("qwen2", "tp2-pp2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    source = open_checkpoint(str(ckpt.role_dir))
    k = load_folder(tmp_path / "out")["model.layers.3.self_attn.k_proj.weight"]
    assert source.check_round_trip("model.layers.3.self_attn.k_proj.weight", k) == 2
    bad = k.clone()
    bad[-1, -1] += 1
    with pytest.raises(VerificationError, match=r"mp_rank_01_001/model.pt: decoder.layers.1.self_attention."
                                                 r"linear_qkv.weight \(k part\)"):
        source.check_round_trip("model.layers.3.self_attn.k_proj.weight", bad)

    # a saved piece changed after the merge: the output no longer round-trips to it
    def tamper(chunks):
        chunks[0]["decoder.layers.1.mlp.linear_fc1.weight"][-1, 0] += 1  # an up_proj row of TP rank 1

    edit_rank_file(rank_file(ckpt, "mp_rank_01_001"), tamper)
    with pytest.raises(VerificationError, match=r"mp_rank_01_001/model.pt: decoder.layers.1.mlp.linear_fc1.weight "
                                                 r"\(up part\)") as excinfo:
        verify_round_trip(open_checkpoint(str(ckpt.role_dir)), tmp_path / "out", {})
    one_line_error(excinfo)


def test_tied_output_copy_must_equal_the_embedding(mcore_copy, tmp_path):
    ckpt = mcore_copy("llama-tied", "tp2-pp2")

    def tamper(chunks):
        chunks[-1]["output_layer.weight"][3, 3] += 1

    edit_rank_file(rank_file(ckpt, "mp_rank_00_001"), tamper)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight") as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not (tmp_path / "out").exists()


# ---- bad inputs: one line each, nothing written -----------------------------------------------

def test_missing_tp_rank_folder(mcore_copy, tmp_path):
    ckpt = mcore_copy("llama", "tp2-pp2")
    shutil.rmtree(ckpt.role_dir / "model" / "mp_rank_00_001")
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001: missing .*copy every mp_rank_\* folder") as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not (tmp_path / "out").exists()


def test_missing_last_tp_rank_is_found_from_shard_shapes(mcore_copy, tmp_path):
    ckpt = mcore_copy("qwen2", "tp2")
    shutil.rmtree(ckpt.role_dir / "model" / "mp_rank_01")
    with pytest.raises(CheckpointError, match=r"model/mp_rank_01: missing .*implies TP=2") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_inconsistent_tp_shard_shape(mcore_copy):
    ckpt = mcore_copy("llama", "tp2")

    def shrink(chunks):
        chunks[0]["decoder.layers.2.mlp.linear_fc1.weight"] = chunks[0]["decoder.layers.2.mlp.linear_fc1.weight"][:96].clone()

    edit_rank_file(rank_file(ckpt, "mp_rank_01"), shrink)
    with pytest.raises(CheckpointError, match=r"mp_rank_01/model.pt: decoder.layers.2.mlp.linear_fc1.weight is "
                                              r"\(96, 64\) .* but \(128, 64\)") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_heads_not_divisible_by_tp(mcore_copy):
    ckpt = mcore_copy("llama", "tp2")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(num_attention_heads=3, num_key_value_heads=3)
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_attention_heads=3 is not divisible by the tensor parallel size 2") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_unknown_parameter_names_the_key_and_custom_mapping(mcore_copy, tmp_path):
    ckpt = mcore_copy("llama", "tp2")
    for folder in ("mp_rank_00", "mp_rank_01"):
        edit_rank_file(rank_file(ckpt, folder), lambda c: c[0].__setitem__("decoder.layers.1.mlp.mystery.weight", torch.ones(4)))
    with pytest.raises(CheckpointError, match=r"decoder.layers.1.mlp.mystery.weight .*--custom-mapping FILE") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)

    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"decoder.layers.{}.mlp.mystery.weight": ["model.layers.{}.mlp.mystery.weight", "replicated"]}))
    source = MegatronLegacyCheckpoint(open_checkpoint(str(ckpt.role_dir)).location, custom_mapping=str(mapping))
    source.validate()
    assert source.tensors()["model.layers.1.mlp.mystery.weight"].shape == (4,)


def test_custom_mapping_through_the_cli(mcore_copy, cli, tmp_path):
    """merge records the mapping in the manifest, so verify re-reads the source with it; inspect takes it too."""
    ckpt = mcore_copy("llama", "tp2")
    for folder in ("mp_rank_00", "mp_rank_01"):
        edit_rank_file(rank_file(ckpt, folder), lambda c: c[0].__setitem__("decoder.layers.1.mlp.mystery.weight", torch.ones(4)))
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"decoder.layers.{}.mlp.mystery.weight": ["model.layers.{}.mlp.mystery.weight", "replicated"]}))
    assert cli("inspect", ckpt.role_dir, "--json").exit_code == 2  # the unknown key, without the mapping
    result = cli("inspect", ckpt.role_dir, "--json", "--custom-mapping", mapping)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["checkpoint"]["custom_mapping"] == str(mapping)
    out = tmp_path / "out"
    # LlamaForCausalLM (transformers knows it) saves no such tensor: the mapping cannot vouch for it
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", out, "--custom-mapping", mapping)
    assert result.exit_code == 2 and "unexpected model.layers.1.mlp.mystery.weight" in result.stderr, result.output
    config_path = ckpt.role_dir / "huggingface" / "config.json"  # custom code: only the shape table can judge
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "architectures": ["MysteryForCausalLM"]}))
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", out, "--custom-mapping", mapping)
    assert result.exit_code == 0, result.output
    assert "model.layers.1.mlp.mystery.weight" in load_folder(out)
    check = json.loads((out / "ckptflow_manifest.json").read_text())["source"]["options"]["config_check"]
    assert check["by"] == "shape table" and "MysteryForCausalLM" in check["why"]
    result = cli("verify", out)
    assert result.exit_code == 0, result.output
    assert "round-trip" in result.stdout


def test_replicated_norm_differs_across_tp_ranks(mcore_copy):
    ckpt = mcore_copy("qwen3", "tp2")
    edit_rank_file(rank_file(ckpt, "mp_rank_01"),
                   lambda c: c[0]["decoder.layers.0.self_attention.k_layernorm.weight"].add_(1))
    with pytest.raises(CheckpointError, match=r"mp_rank_01/model.pt: decoder.layers.0.self_attention.k_layernorm.weight "
                                              "differs from its copy") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_layer_count_must_match_the_config(mcore_copy):
    ckpt = mcore_copy("mistral", "tp2-pp2")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_hidden_layers": 5}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=5 .*layer 4 missing") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_unknown_model_type_without_mapping(mcore_copy):
    ckpt = mcore_copy("llama", "tp2")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "gpt_mystery"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt_mystery' has no Megatron mapping table") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)


def test_merge_imports_no_torch_and_streams_within_a_tiny_budget(mcore, tmp_path):
    """A legacy merge never imports torch (model.pt files are read as numpy views), and with a 4 KB chunk
    budget (QKV groups, [gate; up] halves, TP concat on both dims and vocab padding cut across row blocks)
    the output equals save_pretrained's."""
    import os
    import subprocess
    import sys

    ckpt = mcore("qwen2", "tp2-pp2")
    code = ("import json, sys\n"
            "from mergecore import merge_checkpoint\n"
            f"merge_checkpoint({str(ckpt.role_dir)!r}, {str(tmp_path / 'out')!r}, dtype='keep')\n"
            "print(json.dumps('torch' in sys.modules))\n")
    root = REPO
    env = {**os.environ, "CKPTFLOW_CHUNK_BYTES": "4KB", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
