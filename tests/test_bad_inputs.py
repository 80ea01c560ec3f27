"""Bad input: one line naming the file and the fix, exit code 2, nothing written to the target."""

from __future__ import annotations

import json

import pytest
import torch


def assert_refused(result, target, *fragments):
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*"))


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
                                                  ("num_hidden_layers", 3, "num_hidden_layers=3")])
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
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    result = merge(cli, demo("fsdp2-w2").role_dir, target)
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    assert (target / "keep.txt").read_text() == "precious"
    assert merge(cli, demo("fsdp2-w2").role_dir, target, "--overwrite").exit_code == 0
    assert not (target / "keep.txt").exists() and (target / "config.json").exists()


def test_private_without_an_upload_path_is_refused_not_ignored(cli, demo, tmp_path):
    result = merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", "--private")
    assert_refused(result, tmp_path / "out", "--private only applies with --hf_upload_path")


def test_value_model_flag_checked_against_config(cli, demo, tmp_path):
    assert_refused(merge(cli, demo("fsdp2-w2").role_dir, tmp_path / "out", "--is-value-model"), tmp_path / "out", "ForTokenClassification")
    assert merge(cli, demo("critic-w2").role_dir, tmp_path / "critic", "--is-value-model").exit_code == 0
