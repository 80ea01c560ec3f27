"""Torch distributed checkpoints (`--backend dcp`, found by `auto`): folders written by torch's own `dcp.save` of
`get_model_state_dict` on gloo ranks — FSDP2 (even and uneven boxes), HSDP, FSDP2 + tensor parallel on a (dp, tp)
mesh — as a plain folder and in torchtitan's and Accelerate's layouts. Expected values: the trained model's own
`save_pretrained` (reference/) and its logits, compared by `ckptflow test`."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_refused, upload
from mergecore import open_checkpoint
from weights import load_folder

DCP_KINDS = ["dcp-fsdp2", "dcp-fsdp2-w3", "dcp-torchtitan", "dcp-accelerate", "dcp-hsdp", "dcp-fsdp2-tp"]


@pytest.mark.parametrize("kind", DCP_KINDS)
def test_every_dcp_layout_merges_to_save_pretrained_and_its_logits(kind, demo, cli, tmp_path):
    """The run folder as the framework leaves it (torchtitan: RUN/checkpoint/step-N; Accelerate: the folder of
    pytorch_model_fsdp_0), config and tokenizer from --hf_model_path: every tensor bit for bit, logits equal."""
    ckpt = demo(kind)
    result = cli("test", "--local_dir", ckpt.role_dir, "--hf_model_path", ckpt.reference_dir, "--test_hf_dir",
                 ckpt.reference_dir, "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    assert "test passed" in result.stdout and "logits" in result.stdout


def test_the_layout_is_found_and_only_the_models_keys_are_read(demo):
    titan = open_checkpoint(str(demo("dcp-torchtitan").role_dir), backend="auto")
    assert titan.describe()["layout"] == "torchtitan" and titan.step == 1 and titan.location.name == "step-1"
    accelerate = open_checkpoint(str(demo("dcp-accelerate").role_dir))
    assert accelerate.describe()["layout"] == "accelerate" and accelerate.location.name == "pytorch_model_fsdp_0"
    reference = set(load_folder(demo("dcp-accelerate").reference_dir))
    assert set(accelerate.tensors()) == reference  # `model.` taken off, optimizer_0/ never opened
    earlier = open_checkpoint(str(demo("dcp-torchtitan").role_dir / "checkpoint" / "step-0"))
    assert any(k.startswith("optimizer.") for k in earlier.metadata.state_dict_metadata)  # the fixture has them
    assert set(earlier.tensors()) == set(load_folder(demo("dcp-torchtitan").reference_dir))
    tp = open_checkpoint(str(demo("dcp-fsdp2-tp").role_dir))
    layouts = {info.layout for info in tp.tensors().values()}
    assert "DCP: 4 boxes, cut along dim 0 (2), dim 1 (2)" in layouts  # row-parallel: (Shard(0), Shard(1))
    assert "DCP: 4 boxes, cut along dim 0 (4)" in layouts  # column-parallel: (_StridedShard(0), Shard(0))


def test_without_a_config_it_is_one_line_naming_hf_model_path(demo, cli, tmp_path):
    result = cli("merge", "--local_dir", demo("dcp-fsdp2").role_dir, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "--hf_model_path")


def test_only_config_and_tokenizer_files_come_from_hf_model_path(demo, cli, tmp_path):
    """--hf_model_path names a full Hugging Face folder (the reference holds weights): its weights are not copied."""
    ckpt = demo("dcp-fsdp2")
    result = cli("merge", "--local_dir", ckpt.role_dir, "--hf_model_path", ckpt.reference_dir, "--target_dir",
                 tmp_path / "out", "--max-shard-size", "200KB")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "ckptflow_manifest.json").read_text())
    assert "model.safetensors" not in manifest["files"] and len([f for f in manifest["files"] if f.endswith(
        ".safetensors")]) > 1
    assert {"config.json", "tokenizer_config.json"} <= set(manifest["files"])
    assert cli("verify", tmp_path / "out").exit_code == 0


def test_a_dcp_checkpoint_on_object_storage_merges_by_byte_ranges(s3_env, demo, cli, tmp_path):
    ckpt = demo("dcp-fsdp2-tp")
    url = upload(s3_env, ckpt, "ckpts/dcp-tp")
    result = cli("merge", "--local_dir", url, "--hf_model_path", ckpt.reference_dir, "--target_dir", tmp_path / "out",
                 "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    merged, reference = load_folder(tmp_path / "out"), load_folder(ckpt.reference_dir)
    assert sorted(merged) == sorted(reference)
    assert all(merged[name].equal(reference[name]) for name in reference)


def test_promote_takes_a_torchtitan_run_folder(prefect_server, demo, tmp_path):
    """The pipeline on the run folder torchtitan leaves: merged per group, proven against the trained model."""
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest

    ckpt = demo("dcp-fsdp2-tp")
    result = promote_checkpoint(PromotionRequest.of(str(ckpt.role_dir), str(tmp_path / "model"),
                                                    hf_dir=str(ckpt.reference_dir), reference=str(ckpt.reference_dir)))
    checks = {c["check"]: c["ok"] for c in result["checks"]}
    assert checks == {"round-trip": True, "reference": True, "logits": True}


def test_watch_announces_each_torchtitan_step_once_its_metadata_is_written(demo, tmp_path):
    """`.metadata` is what DCP writes last: without it a step waits; with it, and unchanged over two polls, it is
    complete. Accelerate's optimizer_0/ beside the model is never announced."""
    import shutil

    from mergecore.formats.completeness import poll

    root = tmp_path / "runs"
    shutil.copytree(demo("dcp-torchtitan").role_dir, root / "llama")
    shutil.copytree(demo("dcp-accelerate").role_dir, root / "trl")
    (root / "llama" / "checkpoint" / "step-1" / ".metadata").rename(tmp_path / "held-back")
    first = poll(str(root))
    second = poll(str(root), first.sizes)
    step1, step0 = (str(root / "llama" / "checkpoint" / f"step-{n}") for n in (1, 0))
    accelerate = str(root / "trl" / "pytorch_model_fsdp_0")
    assert sorted(second.complete) == sorted([step0, accelerate]) and "no .metadata" in second.waiting[step1]
    assert not any("optimizer_0" in url for url in [*second.complete, *second.waiting])
    (tmp_path / "held-back").rename(root / "llama" / "checkpoint" / "step-1" / ".metadata")
    assert step1 in poll(str(root), poll(str(root), second.sizes).sizes).complete


def test_an_uploaded_torchtitan_step_is_promoted_with_the_deployments_hf_dir(prefect_server, demo, tmp_path):
    """The event flow derives run and step from RUN/checkpoint/step-N; the deployment's settings name the config."""
    import shutil

    from ckptflow.flows.requests import PromotionSettings
    from ckptflow.flows.service import promote_uploaded

    ckpt = demo("dcp-torchtitan")
    shutil.copytree(ckpt.role_dir, tmp_path / "ckpts" / "llama")
    state = promote_uploaded(checkpoint=str(tmp_path / "ckpts" / "llama" / "checkpoint" / "step-1"),
                             target_root=str(tmp_path / "models"), checkpoint_root=str(tmp_path / "ckpts"),
                             settings=PromotionSettings(hf_dir=str(ckpt.reference_dir)), return_state=True)
    assert state.is_completed(), state.message
    merged = load_folder(tmp_path / "models" / "llama" / "step-1")
    reference = load_folder(ckpt.reference_dir)
    assert sorted(merged) == sorted(reference) and all(merged[n].equal(reference[n].to(merged[n].dtype))
                                                       for n in reference)


class _Opens:
    """A pickle that, once unpickled with plain pickle, creates the file it names."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_accelerates_random_states_pickles_are_never_unpickled(demo, cli, tmp_path):
    """Accelerate's save_state leaves random_states_R.pkl (pickles) beside the model: a hostile one changes nothing."""
    import pickle

    ckpt = demo("dcp-accelerate")
    folder = tmp_path / "trl"
    shutil.copytree(ckpt.role_dir, folder)
    assert sorted(p.name for p in folder.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    marker = tmp_path / "unpickled"
    (folder / "random_states_0.pkl").write_bytes(pickle.dumps(_Opens(marker)))
    result = cli("merge", "--local_dir", folder, "--hf_model_path", ckpt.reference_dir, "--target_dir", tmp_path / "out",
                 "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    assert not marker.exists()
    merged, reference = load_folder(tmp_path / "out"), load_folder(ckpt.reference_dir)
    assert sorted(merged) == sorted(reference) and all(merged[n].equal(reference[n]) for n in reference)
