"""Every decoder family transformers 5 builds, saved as verl 0.9.1 saves it, merges to exactly what the model's own
`save_pretrained` writes and gives the model's own logits.

One session fixture writes all of them in one start of two gloo ranks (`ckptflow_testing.family_models`): a tiny
model of each family (hidden 64, two layers of different kinds, non-square experts, a one-block vision tower
for the VLMs) with seeded noise on every parameter and persistent buffer, wrapped in FSDP2 `fully_shard` as
verl wraps it, each rank's `state_dict()` saved (DTensor shards; persistent buffers as plain tensors, a full copy
per rank). Rank 0 wrote `reference/` from the unwrapped model: its `save_pretrained` and its forward on fixed ids
at one torch thread. Those are the expected values: every tensor is compared bit for bit (names, shapes, dtypes,
values) and the merged folder's logits, at the reference's thread count, must be equal.
"""

from __future__ import annotations


from helpers import torch_threads
import pytest
import torch

from ckptflow.testing.demo_checkpoint import LOGITS_FILE, DemoSpec, write_demo_checkpoints
from ckptflow.testing.family_models import FAMILY_ARCHS, model_class, text_model
from mergecore import merge_checkpoint
from mergecore.formats.fsdp import load_rank_file
from weights import load_folder

# family -> tensors of save_pretrained's files that show the family's own layout was understood
SIGNATURES = {
    # gated full attention: q_proj is 2 x heads x head_dim; linear attention with its own heads and sizes
    "qwen3_5": {"model.language_model.layers.1.self_attn.q_proj.weight": (2 * 4 * 16, 64),
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": (2 * 2 * 8 + 4 * 12, 64)},
    "qwen3_5_moe": {"model.language_model.layers.1.self_attn.q_proj.weight": (2 * 4 * 16, 64),
                    "model.language_model.layers.0.mlp.experts.3.up_proj.weight": (40, 64)},
    # full-attention layers with their own head dim (32, sliding ones 16); persistent buffers
    "gemma4": {"model.language_model.layers.1.self_attn.q_proj.weight": (4 * 32, 64),
               "model.language_model.layers.0.self_attn.q_proj.weight": (4 * 16, 64),
               "model.language_model.layers.1.layer_scalar": (1,),
               "model.vision_tower.encoder.layers.0.self_attn.q_proj.input_min": ()},
    "gemma3": {"language_model.model.embed_tokens.weight": (1001, 64)},
    # MLA: value head dim 24 unlike the query's 16 + 8; one dense then one MoE layer with a persistent buffer
    "deepseek_v3": {"model.layers.1.self_attn.kv_b_proj.weight": (4 * (16 + 24), 32),
                    "model.layers.1.mlp.experts.3.down_proj.weight": (64, 40),
                    "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
                    "model.layers.0.mlp.gate_proj.weight": (96, 64)},
    # untied head named `head.weight` in the Hub's files (was refused: "has no lm_head.weight but
    # tie_word_embeddings=false"); compressed attention, hyper-connections, an integer hash-routing buffer
    "deepseek_v4": {"head.weight": (1001, 64), "model.layers.0.ffn.gate.tid2eid": (1001, 2),
                    "model.layers.1.ffn.experts.3.w2.weight": (64, 40), "model.layers.1.attn.compressor.ape": (8, 32)},
    "glm4_moe": {"model.layers.1.mlp.experts.3.gate_proj.weight": (40, 64),
                 "model.layers.1.mlp.gate.e_score_correction_bias": (4,)},
    "gpt_oss": {"model.layers.1.mlp.experts.gate_up_proj": (4, 64, 80), "model.layers.0.self_attn.sinks": (4,)},
    "qwen3_vl_moe": {"model.language_model.layers.1.mlp.experts.gate_up_proj": (4, 80, 64),
                     "model.language_model.layers.0.mlp.gate_proj.weight": (96, 64)},
    "llama4": {"language_model.model.layers.1.feed_forward.experts.gate_up_proj": (4, 64, 80),
               "language_model.model.layers.0.feed_forward.gate_proj.weight": (96, 64)},
    # q_norm / k_norm over all heads (4 x 16, 2 x 16), not one head's dim
    "olmo3": {"model.layers.1.self_attn.q_norm.weight": (64,), "model.layers.1.self_attn.k_norm.weight": (32,)},
    "minimax_m2": {"model.layers.1.self_attn.q_norm.weight": (64,),
                   "model.layers.1.block_sparse_moe.experts.3.w2.weight": (64, 40)},
    "mixtral_noise": {"model.layers.1.block_sparse_moe.experts.3.w1.weight": (40, 64)},
    # a Mamba-2 layer (in_proj: 128 inner + 160 conv + 4 heads) then an attention layer; config.json holds
    # time_step_limit [0.0, {"__float__": "Infinity"}] (was refused: transformers cannot build it from the dict)
    "bamba": {"model.layers.0.mamba.in_proj.weight": (292, 64), "model.layers.0.mamba.conv1d.weight": (160, 1, 4),
              "model.layers.1.self_attn.q_proj.weight": (64, 64)},
    # its save transposes the router and the shared experts (was refused: "reorders the elements of
    # model.layers.1.mlp.gate.linear.weight"): in memory [experts, hidden] and [56, 64], in the Hub's files transposed
    "ergo": {"layers.1.feed_forward.gate_kernel": (64, 4), "layers.1.feed_forward.shared_up_proj": (64, 56),
             "layers.1.feed_forward.up_proj": (4, 64, 40)},
    # its save joins the vision tower's q, k, v into wqkv with q and k rows permuted per head (was refused:
    # "neither a slice of one saved tensor nor slices joined side by side"), bias included
    "kimi_k25": {"vision_tower.encoder.blocks.0.wqkv.weight": (96, 32), "vision_tower.encoder.blocks.0.wqkv.bias": (96,),
                 "language_model.model.blocks.1.self_attn.kv_b_proj.weight": (4 * (16 + 24), 32)},
    # its save interleaves gate and up rows of the packed experts (in memory gate_up_proj [4, 80, 64])
    "inkling2": {"model.llm.layers.1.mlp.experts.w13_weight": (4, 80, 64)},
    # its save renames LayerNorm weight and bias to the legacy gamma and beta (in memory .weight / .bias)
    "esm": {"esm.encoder.layer.1.LayerNorm.gamma": (64,), "esm.encoder.layer.1.attention.LayerNorm.beta": (64,)},
}


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """arch -> DemoCheckpoint, all written in one start of the rank processes."""
    root = tmp_path_factory.mktemp("families")
    written = write_demo_checkpoints({root / arch: DemoSpec(arch=arch) for arch in FAMILY_ARCHS})
    return {arch: written[root / arch] for arch in FAMILY_ARCHS}


@pytest.fixture(scope="session")
def merged(families, tmp_path_factory):
    """arch -> (merge manifest, merged folder), merged on first use."""
    done = {}

    def get(arch):
        if arch not in done:
            out = tmp_path_factory.mktemp(f"merged-{arch}")
            done[arch] = merge_checkpoint(str(families[arch].role_dir), out, dtype="keep"), out
        return done[arch]

    return get


def _own_logits(arch: str, folder, own: dict):
    """The merged folder's logits on the reference's ids, at the reference's thread count and with the weights in
    freshly allocated memory, as the reference model's were: on some CPUs (AMD EPYC here) a float32 matmul's last
    bit depends on where its operands sit, and from_pretrained leaves them in the mapped file at whatever offset
    the safetensors header gives (docs/facts.md)."""
    with torch_threads(own["threads"]), torch.no_grad():
        model = model_class(arch).from_pretrained(folder, dtype=torch.float32).eval()
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
        return text_model(model, arch)(input_ids=own["input_ids"]).logits.float()


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_merges_to_save_pretrained_files_and_own_logits(arch, families, merged):
    manifest, out = merged(arch)
    assert manifest["source"]["options"]["config_check"]["by"] == "transformers"
    weights, reference = load_folder(out), load_folder(families[arch].reference_dir)
    assert sorted(weights) == sorted(reference)
    for name, shape in SIGNATURES[arch].items():
        assert tuple(reference[name].shape) == shape, name  # the fixture is the family it claims to be
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and weights[name].shape == tensor.shape, name
        assert torch.equal(weights[name], tensor), name
    own = torch.load(families[arch].reference_dir / LOGITS_FILE, weights_only=True)
    assert own["threads"] == 1
    assert torch.equal(_own_logits(arch, out, own), own["logits"])


@pytest.mark.parametrize("arch, head, embeddings", [
    ("gemma3", "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"),
    ("gemma4", "lm_head.weight", "model.language_model.embed_tokens.weight"),
])
def test_tied_head_of_a_vlm_is_written_once(arch, head, embeddings, families, merged):
    """The rank files hold the tied head under its in-memory name (`lm_head.weight`); save_pretrained drops it
    under the Hub's name, and so does the merge, recording which tensor holds its values."""
    state = load_rank_file(str(families[arch].role_dir / "model_world_size_2_rank_0.pt"), "rank 0")
    assert "lm_head.weight" in state
    manifest, out = merged(arch)
    assert manifest["aliases"] == {head: embeddings}
    assert head not in load_folder(out) and head not in load_folder(families[arch].reference_dir)


def test_gemma4_buffers_are_written_once_as_save_pretrained_writes_them(families, merged):
    """verl's FSDP2 files hold persistent buffers as plain tensors, a whole copy on every rank (verl #7610: its
    own merger concatenates them across ranks). The merge writes one copy, with the shape and values save_pretrained
    writes; non-persistent buffers (rotary inv_freq) are in neither."""
    ckpt = families["gemma4"]
    ranks = [load_rank_file(str(ckpt.role_dir / f"model_world_size_2_rank_{r}.pt"), f"rank {r}") for r in (0, 1)]
    buffers = [n for n in ranks[0] if n.endswith(("layer_scalar", "input_min", "output_max"))]
    assert len(buffers) >= 4
    reference = load_folder(ckpt.reference_dir)
    weights = load_folder(merged("gemma4")[1])
    for name in buffers:
        copies = [torch.from_numpy(rank[name].copy()) for rank in ranks]
        assert torch.equal(copies[0], copies[1]) and copies[0].shape == reference[name].shape, name  # whole copies
        assert torch.equal(weights[name], reference[name]) and weights[name].shape == reference[name].shape, name
    assert not any("inv_freq" in n for n in weights) and not any("inv_freq" in n for n in ranks[0])


def test_buffer_copies_that_differ_across_ranks_are_refused(families, cli, tmp_path):
    """A buffer the ranks did not keep in sync: one line naming the rank file and the fix, exit 2, nothing written
    (it used to pass the checks and fail verification as "the merge is wrong, please report this")."""
    import shutil

    import torch.distributed.tensor  # noqa: F401  (unpickles the DTensors of the rank file)

    from helpers import assert_refused

    role = tmp_path / "actor"
    shutil.copytree(families["gemma4"].role_dir, role)
    rank1 = role / "model_world_size_2_rank_1.pt"
    state = torch.load(rank1, map_location="cpu", weights_only=True)
    state["model.language_model.layers.1.layer_scalar"] = state["model.language_model.layers.1.layer_scalar"] + 1
    torch.save(state, rank1)
    result = cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "model_world_size_2_rank_1.pt", "layers.1.layer_scalar", "diverged")


@pytest.mark.parametrize("arch", ["gemma4", "deepseek_v4"])
def test_bf16_merge_casts_floating_tensors_and_buffers_like_model_to(arch, families, tmp_path):
    """A bf16 merge is save_pretrained of `model.to(torch.bfloat16)`: float weights and float buffers (Gemma 4's
    clip bounds) cast, integer buffers (DeepSeek-V4's hash routing table) kept."""
    merge_checkpoint(str(families[arch].role_dir), tmp_path / "bf16", dtype="bf16")
    weights, reference = load_folder(tmp_path / "bf16"), load_folder(families[arch].reference_dir)
    assert sorted(weights) == sorted(reference)
    for name, tensor in reference.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert weights[name].dtype == want.dtype and torch.equal(weights[name], want), name
    assert any(not t.is_floating_point() for t in weights.values()) == (arch == "deepseek_v4")


def test_untied_causal_lm_without_its_head_is_refused(families, cli, tmp_path):
    """The check DeepSeek-V4's `head.weight` no longer trips still holds where save_pretrained writes `lm_head.weight`:
    rank files without it and an untied config are one line naming the fix."""
    import shutil

    import torch.distributed.tensor  # noqa: F401  (unpickles the DTensors of the rank files)

    from helpers import assert_refused

    role = tmp_path / "actor"
    shutil.copytree(families["mixtral_noise"].role_dir, role)
    for rank_file in role.glob("model_world_size_2_rank_*.pt"):
        state = torch.load(rank_file, map_location="cpu", weights_only=True)
        del state["lm_head.weight"]
        torch.save(state, rank_file)
    result = cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "has no lm_head.weight", "tie_word_embeddings=false", "set it to true")


def test_a_config_with_a_non_finite_number_is_read_as_transformers_reads_it_and_written_as_it_writes_it(families,
                                                                                                       merged):
    """transformers writes a non-finite config value as {"__float__": "Infinity"} (Mamba hybrids' time_step_limit)
    and decodes it when it loads; the merge's config check reads it so, and config.json goes out as written."""
    import json

    written = json.loads((families["bamba"].reference_dir / "config.json").read_text())
    assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]  # the fixture holds the case
    merged_config = json.loads((merged("bamba")[1] / "config.json").read_text())
    assert merged_config["time_step_limit"] == written["time_step_limit"]


def test_transposed_outputs_stream_in_row_blocks(families, tmp_path, monkeypatch):
    """Ergo's Hub files hold the router and shared experts transposed: each output row block reads a column block
    of every rank's rows (a strided view), within a chunk budget of a few rows, and the round trip finds each
    saved piece in place."""
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", "512")  # 2 rows of 64 fp32; 4 rows of shared_up_proj's 56
    merge_checkpoint(str(families["ergo"].role_dir), tmp_path / "out", dtype="keep")
    weights, reference = load_folder(tmp_path / "out"), load_folder(families["ergo"].reference_dir)
    for name in ("layers.1.feed_forward.gate_kernel", "layers.1.feed_forward.shared_up_proj"):
        assert torch.equal(weights[name], reference[name]), name


@pytest.mark.parametrize("arch, name", [("kimi_k25", "vision_tower.encoder.blocks.0.wqkv.weight"),
                                        ("inkling2", "model.llm.layers.1.mlp.experts.w13_weight")])
def test_reordered_outputs_stream_in_row_blocks(arch, name, families, tmp_path, monkeypatch):
    """Outputs whose save permutes elements along one dim (Kimi-K2.5's q/k rows per head, Inkling's interleaved
    gate/up rows) are read as runs of each rank's rows placed where the permutation puts them: within a chunk
    budget of a couple of rows, every block equal to save_pretrained's, and the round trip finds every element."""
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", "256")  # 2 rows of 32 fp32; one 64-wide row of an expert
    merge_checkpoint(str(families[arch].role_dir), tmp_path / "out", dtype="keep")
    weights, reference = load_folder(tmp_path / "out"), load_folder(families[arch].reference_dir)
    assert torch.equal(weights[name], reference[name])
