"""Bad input: one line naming the file and the fix, exit code 2, nothing written to the target."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import assert_refused


def error_lines(result) -> int:
    """Lines of error text (the progress bar of a merge that went well may stand before it)."""
    return len(result.stderr.split("error:", 1)[-1].strip().splitlines())


def merge(cli, source, target, *extra):
    return cli("merge", "--backend", "fsdp", "--local_dir", source, "--target_dir", target, *extra)


def test_missing_rank(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    (ckpt.role_dir / "model_world_size_2_rank_1.pt").unlink()
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "model_world_size_2_rank_1.pt: missing")


def test_truncated_rank_file(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    path = ckpt.role_dir / "model_world_size_2_rank_1.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "rank_1.pt: cannot be read", "copy it again")


def test_wrong_world_size_in_fsdp_config(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    (ckpt.role_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "fsdp_config.json: says world_size 4")


def test_rank_file_from_another_world_size(cli, demo, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    other = demo("fsdp2-w4-placement").role_dir / "model_world_size_4_rank_1.pt"
    (ckpt.role_dir / "model_world_size_2_rank_1.pt").write_bytes(other.read_bytes())
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "rank_1.pt")


@pytest.mark.parametrize("field, value, tensor", [("hidden_size", 32, "model.embed_tokens.weight"),
                                                  ("vocab_size", 1024, "model.embed_tokens.weight"),
                                                  ("num_key_value_heads", 4, "k_proj"),
                                                  # transformers refuses it: 3 layers but 2 layer_types
                                                  ("num_hidden_layers", 3, "`num_hidden_layers` (3)")])
def test_config_disagrees_with_shapes(cli, demo_copy, tmp_path, field, value, tensor):
    ckpt = demo_copy("fsdp2-w2")
    config_path = ckpt.role_dir / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config[field] = value
    config_path.write_text(json.dumps(config))
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", tensor, "config.json")


def test_tied_flag_contradicting_config(cli, demo, tmp_path):
    result = merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", "--tie-word-embedding")
    assert_refused(result, tmp_path / "out", "--tie-word-embedding true contradicts tie_word_embeddings=false")


def test_config_claims_tied_but_heads_differ(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    config_path = ckpt.role_dir / "huggingface" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": True}))
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "lm_head.weight differs")


def test_keys_differ_between_ranks(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    path = ckpt.role_dir / "model_world_size_2_rank_1.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    del state["model.norm.weight"]
    torch.save(state, path)
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "model.norm.weight is missing from this rank")


def test_empty_folder(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(merge(cli, tmp_path / "empty", tmp_path / "out"), tmp_path / "out", "no checkpoint found")


def test_missing_huggingface_folder_points_to_hf_model_path(cli, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    import shutil

    shutil.rmtree(ckpt.role_dir / "huggingface")
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", "--hf_model_path")
    result = merge(cli, ckpt.role_dir, tmp_path / "out", "--hf_model_path", ckpt.reference_dir)
    assert result.exit_code == 0, result.output


def test_non_empty_target_needs_overwrite(cli, demo, tmp_path):
    """--overwrite replaces an empty folder or a model ckptflow published; a folder of someone's own files is
    never replaced (it used to be, silently)."""
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    for flags in ((), ("--overwrite",)):
        result = merge(cli, role_dir, target, *flags)
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "not a model ckptflow published" in result.stderr and "empty it" in result.stderr
        assert sorted(os.listdir(tmp_path)) == ["out"] and (target / "keep.txt").read_text() == "precious"
    (target / "keep.txt").unlink()
    assert merge(cli, role_dir, target).exit_code == 0  # an empty folder needs no flag
    result = merge(cli, role_dir, target, "--dtype", "fp16")
    assert result.exit_code == 2 and "--overwrite" in result.stderr  # a published model needs the flag
    assert merge(cli, role_dir, target, "--dtype", "fp16", "--overwrite").exit_code == 0
    assert json.loads((target / "ckptflow_manifest.json").read_text())["dtype"] == "float16"


def test_private_without_an_upload_path_is_refused_not_ignored(cli, demo, tmp_path):
    result = merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", "--private")
    assert_refused(result, tmp_path / "out", "--private only applies with --hf_upload_path")


def test_value_model_flag_checked_against_config(cli, demo, tmp_path):
    assert_refused(merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", "--is-value-model"), tmp_path / "out", "ForTokenClassification")
    assert merge(cli, demo("critic-w2").role_dir, tmp_path / "critic", "--is-value-model").exit_code == 0


@pytest.mark.parametrize("flags, fragment", [
    (["--revision", "step-1"], "--revision only applies with --hf_upload_path"),
    (["--public"], "--public only applies with --hf_upload_path"),
    (["--trust-remote-code"], "--trust-remote-code: merge never loads model code"),
])
def test_flags_that_would_do_nothing_are_refused(cli, demo, tmp_path, flags, fragment):
    assert_refused(merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", *flags), tmp_path / "out", fragment)


# A user-supplied file in every place the merge reads one, damaged: (file under the role folder, content, fragment)
MALFORMED = {
    "fsdp_config not JSON": ("fsdp_config.json", "{world_size: 2", "fsdp_config.json: not valid JSON"),
    "fsdp_config a list": ("fsdp_config.json", "[2]", "fsdp_config.json: holds a JSON list"),
    "fsdp_config world_size text": ("fsdp_config.json", '{"world_size": "two"}', "world_size is 'two'"),
    "config not JSON": ("huggingface/config.json", "{", "config.json: not valid JSON"),
    "config a list": ("huggingface/config.json", "[]", "config.json: holds a JSON list"),
    "config not UTF-8": ("huggingface/config.json", b"\xff\xfe{", "config.json: not valid JSON"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_is_one_line(cli, demo_copy, tmp_path, case):
    name, content, fragment = MALFORMED[case]
    ckpt = demo_copy("fsdp2-w2")
    path = ckpt.role_dir / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_refused(merge(cli, ckpt.role_dir, tmp_path / "out"), tmp_path / "out", fragment)


def test_verify_and_test_refuse_malformed_folders(cli, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    out = tmp_path / "out"
    assert merge(cli, ckpt.role_dir, out).exit_code == 0
    (out / "ckptflow_manifest.json").write_text('{"files": [')
    result = cli("verify", out)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "ckptflow_manifest.json: not valid JSON" in result.stderr
    (out / "ckptflow_manifest.json").write_text('{"files": {"../../etc/passwd": {"sha256": "0", "size": 1}}, "source": {}}')
    result = cli("verify", out)
    assert result.exit_code == 2 and "lacks its files or source entries" in result.stderr

    reference = tmp_path / "reference"
    shutil.copytree(ckpt.reference_dir, reference)
    (reference / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../model.safetensors"}}')
    result = cli("test", "--local_dir", ckpt.role_dir, "--test_hf_dir", reference)
    assert result.exit_code == 2 and error_lines(result) == 1 and "weight_map is not a mapping" in result.stderr
    (reference / "model.safetensors.index.json").unlink()
    weights = reference / "model.safetensors"
    weights.write_bytes((10**9).to_bytes(8, "little") + weights.read_bytes()[8:])  # header length past the end
    result = cli("test", "--local_dir", ckpt.role_dir, "--test_hf_dir", reference)
    assert result.exit_code == 2 and "model.safetensors: not a valid safetensors file" in result.stderr


def test_verify_flags_need_a_reference(cli, demo, tmp_path):
    out = tmp_path / "out"
    assert merge(cli, demo("fsdp2-w2").role_dir, out).exit_code == 0
    for flags in (["--logits"], ["--atol", "0.1"], ["--trust-remote-code"]):
        result = cli("verify", out, *flags)
        assert result.exit_code == 2 and "add --reference FOLDER" in result.stderr, flags
