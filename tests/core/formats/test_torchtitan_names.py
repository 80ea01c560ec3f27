"""Checkpoints of torchtitan's own models (`tok_embeddings`, `layers.N.attention.qkv_linear.wq`, ...), written by
torchtitan 0.3.0's own CheckpointManager from FSDP2 ranks (tests/torchtitan_save.py). Expected values: torchtitan's
own `StateDictAdapter.to_hf` of the trained model, `save_pretrained` by transformers (reference/), and the
torchtitan model's own forward (reference/logits.pt)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ckptflow.testing.demo_checkpoint import LOGITS_FILE
from helpers import assert_refused, upload
from mergecore import open_checkpoint
from weights import load_folder


# torchtitan's grouped experts multiply in bfloat16 (GroupedExperts casts x and w1/w2/w3) where transformers stays in
# float32: 4e-5 apart on the Qwen 3 MoE fixture, while swapping two experts of one layer moves the logits by 2.5e-3
LOGITS_ATOL = {"qwen3_moe": 4e-4, "deepseek_v3": 4e-4}


def assert_torchtitans_own(merged, reference, atol: float = 1e-5) -> None:
    """Every tensor bit for bit as torchtitan's adapter gives it, and the logits of torchtitan's own forward."""
    from transformers import AutoModelForCausalLM

    ours, theirs = load_folder(merged), load_folder(reference)
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if not ours[name].equal(theirs[name])] == []
    own = torch.load(reference / LOGITS_FILE, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(own["input_ids"]).logits
    assert torch.allclose(logits, own["logits"], rtol=0, atol=atol), (logits - own["logits"]).abs().max()


@pytest.mark.parametrize("model", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3", "llama3_tp"])
def test_torchtitans_own_model_merges_as_its_adapter_converts_it(model, titan, cli, tmp_path):
    """The run folder (newest step: model-only), config from --hf_model_path; Llama 3's q/k rows permuted; Qwen 3
    MoE's grouped experts split one Hub tensor per expert, its load-balancing bias left out (as the adapter does);
    DeepSeek-V3's latent attention, dense first layer, shared experts and trained routing bias; Llama 3 under
    torchtitan's own tensor-parallel plan with FSDP2 on a (2, 2) mesh (`_StridedShard` and `Shard` boxes, the
    q/k rows permuted across them)."""
    run, reference = titan(model)
    result = cli("merge", "--local_dir", run, "--hf_model_path", reference, "--target_dir", tmp_path / "out",
                 "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    assert_torchtitans_own(tmp_path / "out", reference, LOGITS_ATOL.get(model, 1e-5))
    assert cli("verify", tmp_path / "out", "--source", run, "--hf_model_path", reference).exit_code == 0
    shown = cli("inspect", run, "--hf_model_path", reference)
    world = 4 if model.endswith("_tp") else 2
    assert shown.exit_code == 0 and f"layout: torchtitan, world_size: {world}" in shown.stdout, shown.stderr


def test_rope_rows_stream_in_small_blocks_from_a_step_with_optimizer_state(titan, cli, tmp_path, monkeypatch):
    """Step 1 holds torchtitan's optimizer, scheduler and training state beside the model (never read); with a
    chunk budget of a few rows every q/k tensor is placed from strided runs, block by block."""
    run, reference = titan("llama3")
    step = run / "checkpoint" / "step-1"
    saved = open_checkpoint(str(step), hf_dir=str(reference))
    assert any(key.startswith("optimizer.") for key in saved.metadata.state_dict_metadata)
    q = saved.tensors()["model.layers.0.self_attn.q_proj.weight"]
    assert q.layout == "DCP: 1 box, whole; torchtitan's name, rows InterleavedRope(4, 16)"
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", "2048")  # 8 fp32 rows of 64
    result = cli("merge", "--local_dir", step, "--hf_model_path", reference, "--target_dir", tmp_path / "out",
                 "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    merged = load_folder(tmp_path / "out")
    adapter = _llama3_to_hf(saved, reference)
    assert sorted(merged) == sorted(adapter)
    assert [name for name in adapter if not merged[name].equal(adapter[name])] == []


def _llama3_to_hf(saved, reference) -> dict:
    """torchtitan's own conversion rule for Llama 3 q/k (its `_permute`), applied to the saved step's tensors as
    torch's DCP loads them: what the merge of that step must write."""
    import torch.distributed.checkpoint as dcp

    config = json.loads((reference / "config.json").read_text())
    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    keys = [k for k, md in saved.metadata.state_dict_metadata.items() if hasattr(md, "chunks")
            and not k.startswith(("optimizer.", "train_state", "lr_scheduler"))]
    state = {k: torch.empty(tuple(saved.metadata.state_dict_metadata[k].size)) for k in keys}
    dcp.load(state, checkpoint_id=str(saved.location.local_file()), no_dist=True)

    def permute(w, n):  # torchtitan's Llama3StateDictAdapter._permute, as its to_hf calls it
        return w.view(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    parts = {"attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
             "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
             "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    out = {}
    for key, value in state.items():
        if key in names:
            out[names[key]] = value
            continue
        _, layer, rest = key.split(".", 2)
        part = rest.rsplit(".", 1)[0]
        if part.endswith("wq"):
            value = permute(value, heads)
        elif part.endswith("wk"):
            value = permute(value, kv)
        assert head_dim * heads == config["hidden_size"]
        out[f"model.layers.{layer}.{parts[part]}.weight"] = value
    return out


def test_torchtitan_run_on_object_storage_merges_by_byte_ranges(titan, s3_env, cli, tmp_path):
    run, reference = titan("llama3")
    s3_env.mkdir("titan")
    s3_env.put(str(run / "checkpoint" / "step-2"), "titan/run/checkpoint/step-2", recursive=True)
    result = cli("merge", "--local_dir", "s3://titan/run", "--hf_model_path", reference, "--target_dir",
                 tmp_path / "out", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    assert_torchtitans_own(tmp_path / "out", reference)


def test_a_config_of_another_model_is_one_line(titan, cli, tmp_path):
    """Qwen 3 names with a Llama config: q_norm has no Llama name; Llama names with a Qwen 3 config: the config check
    misses q/k norms; a config torchtitan has no table for: named."""
    run, qwen3_reference = titan("qwen3")
    llama_run, llama_reference = titan("llama3")
    result = cli("merge", "--local_dir", llama_run, "--hf_model_path", qwen3_reference, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "missing model.layers.0.self_attn.q_norm.weight")
    result = cli("merge", "--local_dir", run, "--hf_model_path", llama_reference, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "q_norm.weight has no Hugging Face name for torchtitan's llama model")
    other = tmp_path / "mistral"
    shutil.copytree(llama_reference, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    result = cli("merge", "--local_dir", run, "--hf_model_path", other, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "'mistral' model")
