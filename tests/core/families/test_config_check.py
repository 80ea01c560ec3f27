"""config.json is checked against what the merge writes by transformers itself: the model it names, built on the meta
device, must save exactly the merged tensor names and shapes (`mergecore.families.config_check`).

Qwen3-Next is the family the old hand-written shape table refused (gated full attention makes `q_proj`
2 x heads x head_dim wide; linear attention has its own head count and size): a tiny `Qwen3NextForCausalLM`
(one linear-attention and one full-attention layer, both MoE) trained one step under real FSDP2 on 2 gloo ranks
and saved as verl saves it. `reference/` is its own save_pretrained and its own forward (one torch thread).
"""

from __future__ import annotations

from helpers import cli_in_fresh_process, torch_threads
import json
import pytest
import torch

from ckptflow.testing.demo_checkpoint import LOGITS_FILE
from mergecore import CheckpointError, compare_logits, merge_checkpoint
from weights import load_folder


@pytest.fixture(scope="session")
def qwen3_next(demo):
    return demo("qwen3_next")


def test_qwen3_next_merges_to_save_pretrained_files_and_own_logits(qwen3_next, tmp_path):
    out = tmp_path / "out"
    manifest = merge_checkpoint(str(qwen3_next.role_dir), out, dtype="keep")
    assert manifest["source"]["options"]["config_check"]["by"] == "transformers"
    weights, reference = load_folder(out), load_folder(qwen3_next.reference_dir)
    assert sorted(weights) == sorted(reference)
    assert tuple(reference["model.layers.1.self_attn.q_proj.weight"].shape) == (2 * 4 * 16, 64)  # gated: 2 x heads x head_dim
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in weights and "model.layers.1.mlp.experts.3.up_proj.weight" in weights
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and weights[name].shape == tensor.shape, name
        assert torch.equal(weights[name], tensor), name

    import transformers

    own = torch.load(qwen3_next.reference_dir / LOGITS_FILE, weights_only=True)
    with torch_threads(1), torch.no_grad():  # the reference's thread count
        model = transformers.Qwen3NextForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        logits = model(input_ids=own["input_ids"]).logits
        assert compare_logits(out, qwen3_next.reference_dir)["max_abs_diff"] == 0.0
    torch.testing.assert_close(logits, own["logits"], atol=1e-5, rtol=1e-5)


# ---- configs that cannot describe the weights: one line, exit 2, nothing written


def _merge_with_config(cli, demo_copy, tmp_path, edit):
    run = demo_copy("fsdp2-w2")
    config_path = run.role_dir / "huggingface" / "config.json"
    config_path.write_text(json.dumps(edit(json.loads(config_path.read_text()))))
    target = tmp_path / "out"
    return cli("merge", "--local_dir", run.role_dir, "--target_dir", target), target


def assert_one_line_refusal(result, target, *fragments):
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    for fragment in ("config.json", "--hf_model_path", *fragments):
        assert fragment in message, message
    assert not target.exists() and not list(target.parent.glob(f".{target.name}*"))


def test_config_without_model_type_is_refused(cli, demo_copy, tmp_path):
    result, target = _merge_with_config(cli, demo_copy, tmp_path, lambda config: {})
    assert_one_line_refusal(result, target, "no model_type")


def test_config_of_another_model_is_refused(cli, demo_copy, tmp_path):
    """A Llama config (transformers' defaults for all it does not say) on Qwen2 weights: biases unexpected,
    sizes wrong; named in one line."""
    result, target = _merge_with_config(cli, demo_copy, tmp_path, lambda c: {"model_type": "llama", "hidden_size": 64})
    assert_one_line_refusal(result, target, "LlamaForCausalLM", "unexpected model.layers.0.self_attn.q_proj.bias")


def test_misshaped_config_names_the_tensor(cli, demo, demo_copy, tmp_path):
    """The demo's own config passes (and its answer is cached); the same config with another intermediate_size is a
    new question, refused naming the tensor and both shapes."""
    assert cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "ok").exit_code == 0
    result, target = _merge_with_config(cli, demo_copy, tmp_path, lambda c: {**c, "intermediate_size": 128})
    assert_one_line_refusal(result, target, "model.layers.0.mlp.gate_proj.weight has shape (160, 64) but the config "
                                            "implies (128, 64)")


def test_model_type_transformers_does_not_know_falls_back_to_the_table_and_says_so(demo_copy, tmp_path):
    run = demo_copy("fsdp2-w2")
    config_path = run.role_dir / "huggingface" / "config.json"
    config = {**json.loads(config_path.read_text()), "model_type": "acme_lm", "architectures": ["AcmeForCausalLM"]}
    config_path.write_text(json.dumps(config))
    manifest = merge_checkpoint(str(run.role_dir), tmp_path / "out")
    assert manifest["source"]["options"]["config_check"] == {
        "by": "shape table", "why": "transformers does not know model_type 'acme_lm'", "tensors": 27}
    config_path.write_text(json.dumps({**config, "intermediate_size": 128}))  # the table still checks shapes
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight has shape \(160, 64\)"):
        merge_checkpoint(str(run.role_dir), tmp_path / "out2")


def test_every_family_merge_is_checked_by_transformers(demo, tmp_path):
    """The check runs for the families of the suite, each against its own transformers class."""
    for name, model in (("fsdp2-w2", "Qwen2ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
                        ("gemma3_text", "Gemma3ForCausalLM"), ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
                        ("critic-w2", "Qwen2ForTokenClassification")):
        manifest = merge_checkpoint(str(demo(name).role_dir), tmp_path / name)
        assert manifest["source"]["options"]["config_check"]["model"] == model, name


# ---- a first merge of a config: transformers is asked in a child process, whose imports leave with it

def _first_merge(role_dir, target, cache):
    """`ckptflow merge` in a fresh process with an empty config cache: (process, the modules it imported)."""
    return cli_in_fresh_process("merge", "--local_dir", role_dir, "--target_dir", target, config_cache=cache)


def test_first_merge_of_a_config_imports_neither_torch_nor_transformers(demo, tmp_path):
    """The merging process stays small on a machine's first merge of a config (was: ~240 MiB of torch and
    transformers kept for the whole merge, 357 MiB at vocab 152064): the answer comes from a child, is checked as
    always (the manifest says by transformers' Qwen2ForCausalLM) and kept for the next merge."""
    run, imported = _first_merge(demo("fsdp2-w2").role_dir, tmp_path / "out", tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    assert imported == "imported: []"
    manifest = json.loads((tmp_path / "out" / "ckptflow_manifest.json").read_text())
    assert manifest["source"]["options"]["config_check"] == {"by": "transformers", "model": "Qwen2ForCausalLM",
                                                             "tensors": 27}
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


def test_config_transformers_cannot_build_is_refused_from_the_child_in_one_line(demo_copy, tmp_path):
    """transformers' own complaint, raised in the child, reaches the user as the same one-line error: exit 2,
    nothing written, nothing cached."""
    run = demo_copy("fsdp2-w2")
    config_path = run.role_dir / "huggingface" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "hidden_act": "no_such_activation"}))
    target = tmp_path / "out"
    done, imported = _first_merge(run.role_dir, target, tmp_path / "cache")
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    assert "transformers cannot build Qwen2ForCausalLM" in message and "no_such_activation" in message, message
    assert imported == "imported: []"
    assert not target.exists() and not list((tmp_path / "cache").glob("*.json"))


def test_without_an_interpreter_to_start_the_config_is_asked_here(demo, monkeypatch):
    """A process that cannot start a child (a frozen or embedded Python: `sys.executable` is no interpreter) still
    gets transformers' answer, asked in this process."""
    import sys

    from mergecore.families import config_check

    config = json.loads((demo("fsdp2-w2").role_dir / "huggingface" / "config.json").read_text())
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    answer = config_check._ask_in_child(config)
    assert answer["model"] == "Qwen2ForCausalLM" and "model.embed_tokens.weight" in answer["tensors"]
