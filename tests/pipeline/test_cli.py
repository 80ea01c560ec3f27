"""The command line as verl users and operators drive it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from safetensors.torch import load_file, save_file


def test_verl_spellings_merge_and_test(cli, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    result = cli("merge", "--backend", "fsdp", "--local-dir", ckpt.run_root, "--target-dir", tmp_path / "out",
                 "--max_shard_size", "5GB", "--use_cpu_initialization")
    assert result.exit_code == 0, result.output
    assert "round-trip ok" in result.stdout
    result = cli("test", "--backend", "fsdp", "--local_dir", ckpt.role_dir, "--test_hf_dir", ckpt.reference_dir)
    assert result.exit_code == 0, result.output
    assert "test passed" in result.stdout and "logits" in result.stdout


def test_a_merge_manifest_times_its_preparation(cli, demo, tmp_path):
    """`ckptflow merge` opens, reads and plans the checkpoint before it merges (after checking the target): the
    manifest's prepare phase counts that (it read 0.0), and the phases add up to no more than the command took."""
    started = time.perf_counter()
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out")
    took = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    timings = json.loads((tmp_path / "out" / "ckptflow_manifest.json").read_text())["timings"]
    assert set(timings) == {"prepare", "merge", "verify"}
    assert timings["prepare"] > 0 and sum(timings.values()) <= took


def test_test_fails_on_a_tampered_reference(cli, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    reference = tmp_path / "reference"
    shutil.copytree(ckpt.reference_dir, reference)
    weights = load_file(reference / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3
    save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
    result = cli("test", "--backend", "fsdp", "--local_dir", ckpt.role_dir, "--test_hf_dir", reference)
    assert result.exit_code == 3
    assert "1 tensors differ" in result.stderr and "model.layers.1.mlp.down_proj.weight" in result.stderr
    # Tolerances apply to the tensors and the logits alike.
    result = cli("test", "--local_dir", ckpt.role_dir, "--test_hf_dir", reference, "--atol", "0.01", "--rtol", "0.001")
    assert result.exit_code == 0, result.output
    logits_rows = result.stdout.split("logits", 1)[1]  # the table may wrap the row
    assert "atol=0.01" in logits_rows and "rtol=0.001" in logits_rows


def test_verify_rechecks_hashes_and_round_trip(cli, demo, tmp_path):
    ckpt = demo("fsdp2-w4-placement")
    out = tmp_path / "out"
    assert cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", out, "--dtype", "keep").exit_code == 0
    result = cli("verify", out, "--reference", ckpt.reference_dir, "--logits")
    assert result.exit_code == 0, result.output
    for check in ("manifest", "round-trip", "reference", "logits"):
        assert check in result.stdout

    # A weight changed after the merge, with the manifest rewritten to match: round-trip still catches it.
    weights_file = next(out.glob("model-*.safetensors"))
    weights = load_file(weights_file)
    weights["model.norm.weight"][3] += 1.0
    save_file(weights, weights_file, metadata={"format": "pt"})
    assert cli("verify", out, "--skip-source").exit_code == 3  # hash differs from the manifest
    manifest = json.loads((out / "ckptflow_manifest.json").read_text())
    from mergecore.model.manifest import sha256_file

    manifest["files"][weights_file.name]["sha256"] = sha256_file(weights_file)
    (out / "ckptflow_manifest.json").write_text(json.dumps(manifest))
    result = cli("verify", out)
    assert result.exit_code == 3 and "model.norm.weight" in result.stderr


def test_inspect_json(cli, demo):
    result = cli("inspect", demo("hsdp-2x2").run_root, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"]["world_size"] == 4
    assert report["checkpoint"]["mesh_shape"] == [2, 2]
    assert report["checkpoint"]["mesh_dim_names"] == ["ddp", "fsdp"]
    groups = [g["group"] for g in report["groups"]]
    assert groups == ["embed", "layers.0", "layers.1", "head"]
    assert report["checkpoint"]["bytes"] == sum(g["bytes"] for g in report["groups"])


def test_console_script_exit_code_in_a_real_process(tmp_path):
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "merge", "--local_dir", str(tmp_path / "empty"),
                           "--target_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no checkpoint found" in done.stderr
    assert not (tmp_path / "out").exists()


def test_quick_manifest_check_notices_a_rewritten_file(demo, tmp_path):
    from mergecore import VerificationError, merge_checkpoint, verify_manifest

    out = tmp_path / "out"
    merge_checkpoint(str(demo("fsdp2-w2").role_dir), out)
    assert verify_manifest(out, full=False)["ok"]
    config = out / "config.json"
    config.write_text(config.read_text().replace("bfloat16", "float16"))
    import pytest

    with pytest.raises(VerificationError, match="config.json: differs"):
        verify_manifest(out, full=False)


def test_megatron_legacy_through_the_cli(cli, tmp_path):
    from mergecore import compare_with_reference
    from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint

    ckpt = write_megatron_checkpoint(tmp_path / "run", "qwen2", tp=2, pp=2)
    result = cli("merge", "--backend", "megatron", "--local_dir", ckpt.run_root, "--target_dir", tmp_path / "out",
                 "--dtype", "keep")
    assert result.exit_code == 0, result.output
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    report = json.loads(cli("inspect", ckpt.run_root, "--json").stdout)
    assert report["checkpoint"]["format"] == "verl-megatron-legacy" and report["checkpoint"]["tp"] == 2

    # Without huggingface/: the config comes from --hf_model_path, which the manifest records for `verify`.
    config_dir = tmp_path / "base"
    shutil.move(ckpt.role_dir / "huggingface", config_dir)
    result = cli("merge", "--backend", "megatron", "--local_dir", ckpt.run_root, "--target_dir", tmp_path / "out2",
                 "--hf_model_path", config_dir)
    assert result.exit_code == 0, result.output
    assert cli("verify", tmp_path / "out2").exit_code == 0
    shutil.move(config_dir, tmp_path / "moved")
    result = cli("verify", tmp_path / "out2")
    assert result.exit_code == 2 and "--hf_model_path" in result.stderr
    assert cli("verify", tmp_path / "out2", "--hf_model_path", tmp_path / "moved").exit_code == 0


def test_backend_megatron_reads_dist_ckpt_as_verl_does(cli, tmp_path):
    from mergecore import compare_with_reference
    from ckptflow.testing.megatron_dist_fixtures import write_dist_checkpoint

    ckpt = write_dist_checkpoint(tmp_path / "run", "qwen2")
    result = cli("merge", "--backend", "megatron", "--local_dir", ckpt.run_root, "--target_dir", tmp_path / "out",
                 "--dtype", "keep")
    assert result.exit_code == 0, result.output
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    manifest = json.loads((tmp_path / "out" / "ckptflow_manifest.json").read_text())
    assert manifest["source"]["options"]["backend"] == "megatron_dist"
    assert cli("verify", tmp_path / "out").exit_code == 0


def test_custom_mapping_is_for_megatron_only(cli, demo, tmp_path):
    (tmp_path / "map.json").write_text("{}")
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out",
                 "--custom-mapping", tmp_path / "map.json")
    assert result.exit_code == 2 and "--custom-mapping applies to Megatron" in result.stderr


def test_fsdp_merge_and_verify_never_import_torch(demo, tmp_path):
    """torch's import costs ~2 s per process; the FSDP path reads rank files and casts without it."""
    ckpt = demo("hsdp-2x2")
    script = (
        "import sys\n"
        "from ckptflow.flows.cli import app\n"
        f"app(['merge', '--local_dir', {str(ckpt.role_dir)!r}, '--target_dir', {str(tmp_path / 'out')!r}],"
        " prog_name='ckptflow', standalone_mode=False)\n"
        f"app(['verify', {str(tmp_path / 'out')!r}], prog_name='ckptflow', standalone_mode=False)\n"
        "print('torch imported:', sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "round-trip ok" in done.stdout
    assert "torch imported: []" in done.stdout


def test_flow_heartbeats_are_off_in_process_unless_asked_for():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    from ckptflow.flows.settings import in_process_settings

    with in_process_settings():
        assert get_current_settings().flows.heartbeat_frequency is None
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 60}), in_process_settings():
        assert get_current_settings().flows.heartbeat_frequency == 60


def test_pipeline_commands_without_prefect_name_the_extra(tmp_path):
    """A base install (no `pipeline` extra): promote, promote-latest and deploy say what to install, in one line."""
    for args in (["promote", str(tmp_path), "--target", str(tmp_path / "m")], ["promote-latest", str(tmp_path),
                 "--target-root", str(tmp_path)], ["deploy", "--checkpoint-root", str(tmp_path)]):
        code = ("import sys; sys.modules['prefect'] = None; from ckptflow.flows.cli import main; "
                f"sys.argv = ['ckptflow', *{args!r}]; main()")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "pip install 'ckptflow[pipeline]'" in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
