"""LoRA checkpoints from verl FSDP: peft wraps the model before FSDP2 (full saves and save_lora_only).

Expected values come from the trained PEFT model itself: its own forward (reference/logits.pt), its
`save_pretrained` (reference/lora_adapter/) and `merge_and_unload().save_pretrained` (reference/).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ckptflow_testing.demo_checkpoint import LOGITS_FILE, LORA_ALPHA, LORA_R, DemoSpec, write_demo_checkpoint

pytest.importorskip("peft")


@pytest.fixture(scope="session")
def lora_full(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("lora-full"), DemoSpec(lora=True))


@pytest.fixture(scope="session")
def lora_only(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("lora-only"), DemoSpec(lora=True, lora_only=True))


def _rank0_names(demo) -> list[str]:
    import torch.distributed.tensor  # noqa: F401  (DTensor unpickling)

    return list(torch.load(demo.role_dir / "model_world_size_2_rank_0.pt", weights_only=True, mmap=True))


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ---- the fixture is what verl writes, and its references agree with each other


def test_fixture_full_save_holds_peft_names_and_meta(lora_full):
    names = _rank0_names(lora_full)
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in names
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight" in names
    meta = json.loads((lora_full.role_dir / "lora_train_meta.json").read_text())
    assert meta == {"r": LORA_R, "lora_alpha": LORA_ALPHA, "task_type": "CAUSAL_LM"}


def test_fixture_lora_only_save_holds_adapter_tensors_only(lora_only):
    names = _rank0_names(lora_only)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)


def test_fixture_adapter_matters_and_references_agree(lora_full):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = lora_full.reference_dir
    own = torch.load(ref / LOGITS_FILE, weights_only=True)
    fused = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(ref / "base", dtype=torch.float32)
    base_logits = _logits(base, own["input_ids"])
    with_adapter = PeftModel.from_pretrained(base, ref / "lora_adapter")
    torch.testing.assert_close(_logits(fused, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(with_adapter, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)
    assert (base_logits - own["logits"]).abs().max() > 1e-2  # B is nonzero: the adapter changes the model
    adapter = load_file(ref / "lora_adapter" / "adapter_model.safetensors")
    assert all(t.abs().max() > 0 for n, t in adapter.items() if "lora_B" in n)


# ---- detection, hyperparameters, inspect


def _copy_role(demo, dest):
    import shutil

    shutil.copytree(demo.role_dir, dest)
    return dest


def test_inspect_reports_lora_of_a_full_save(cli, lora_full):
    result = cli("inspect", lora_full.run_root, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    lora = report["lora"]
    assert (lora["save"], lora["r"], lora["alpha"]) == ("full", LORA_R, LORA_ALPHA)
    assert lora["target_modules"] == ["q_proj", "v_proj"] and lora["adapters"] == ["default"]
    assert lora["source"]["alpha"].endswith("lora_train_meta.json") and lora["source"]["target_modules"] == "tensors"
    # adapter tensors group with the layer they adapt, not as extra groups
    assert [g["group"] for g in report["groups"]] == ["embed", "layers.0", "layers.1", "head"]
    table = cli("inspect", lora_full.run_root)
    assert "LoRA (full save): r 8" in table.stdout and "alpha 16" in table.stdout


def test_inspect_reports_a_lora_only_save_and_overrides_win(cli, lora_only):
    report = json.loads(cli("inspect", lora_only.run_root, "--json", "--lora-alpha", "32").stdout)
    assert report["lora"]["save"] == "lora_only"
    assert report["lora"]["alpha"] == 32 and report["lora"]["source"]["alpha"] == "--lora-alpha"
    assert [g["group"] for g in report["groups"]] == ["layers.0", "layers.1"]


def test_alpha_is_never_guessed(cli, lora_full, tmp_path):
    role = _copy_role(lora_full, tmp_path / "actor")
    (role / "lora_train_meta.json").unlink()
    result = cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out")
    assert result.exit_code == 2 and "--lora-alpha" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert json.loads(cli("inspect", role, "--json").stdout)["lora"]["alpha"] is None


def test_rank_contradicting_the_tensors_is_refused(cli, lora_full, tmp_path):
    result = cli("merge", "--local_dir", lora_full.role_dir, "--target_dir", tmp_path / "out", "--lora-r", "4")
    assert result.exit_code == 2 and "rank [8]" in result.stderr and not (tmp_path / "out").exists()


# ---- fused output


@pytest.fixture(scope="module")
def fused(lora_full, tmp_path_factory):
    from typer.testing import CliRunner

    from flows.cli import app

    target = tmp_path_factory.mktemp("fused") / "model"
    result = CliRunner().invoke(app, ["merge", "--local_dir", str(lora_full.run_root), "--target_dir", str(target),
                                      "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    return target


def test_fused_tensors_equal_merge_and_unload(fused, lora_full):
    from mergecore.tensorio import HfWeights

    ref = load_file(lora_full.reference_dir / "model.safetensors")
    with HfWeights(fused) as ours:
        assert sorted(ours.names()) == sorted(ref)
        for name, expected in ref.items():
            torch.testing.assert_close(torch.from_numpy(ours.get(name).copy()), expected, atol=1e-6, rtol=1e-6)
    base = load_file(lora_full.reference_dir / "base" / "model.safetensors")
    assert not torch.equal(ref["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])


def test_fused_model_gives_the_trained_peft_models_logits(fused, lora_full):
    from transformers import AutoModelForCausalLM

    own = torch.load(lora_full.reference_dir / LOGITS_FILE, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32)
    torch.testing.assert_close(_logits(model, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)


def test_fused_merge_round_trip_covers_base_and_adapter_pieces(cli, fused):
    manifest = json.loads((fused / "ckptflow_manifest.json").read_text())
    result = cli("verify", fused)
    assert result.exit_code == 0, result.output
    # 27 HF tensors x 2 ranks, plus A and B (2 ranks each) for 4 adapted weights
    assert "pieces=70" in result.stdout.replace(" ", "")
    assert manifest["source"]["lora"]["alpha"] == LORA_ALPHA and manifest["source"]["lora"]["output"] == "both"
    assert {"lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors"} <= set(manifest["files"])
    card = (fused / "README.md").read_text()
    assert "r=8, alpha=16.0 into q_proj, v_proj" in card and "`lora_adapter/`" in card


def test_default_output_holds_the_adapter_beside_the_fused_model(fused, lora_full):
    ref = load_file(lora_full.reference_dir / "lora_adapter" / "adapter_model.safetensors")
    ours = load_file(fused / "lora_adapter" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)
    own = torch.load(lora_full.reference_dir / LOGITS_FILE, weights_only=True)
    torch.testing.assert_close(_peft_logits(lora_full.reference_dir / "base", fused / "lora_adapter", own["input_ids"]),
                               own["logits"], atol=1e-5, rtol=1e-5)


def test_lora_fuse_writes_no_adapter_and_a_new_alpha_is_not_a_reused_merge(cli, lora_full, tmp_path):
    target = tmp_path / "model"
    assert cli("merge", "--local_dir", lora_full.run_root, "--target_dir", target, "--lora", "fuse",
               "--dtype", "fp32").exit_code == 0
    assert not (target / "lora_adapter").exists()
    q = "model.layers.0.self_attn.q_proj.weight"
    from mergecore.tensorio import HfWeights

    with HfWeights(target) as weights:
        alpha16 = weights.get(q).copy()
    result = cli("merge", "--local_dir", lora_full.run_root, "--target_dir", target, "--lora", "fuse",
                 "--dtype", "fp32", "--lora-alpha", "32", "--overwrite")
    assert result.exit_code == 0, result.output
    with HfWeights(target) as weights:
        alpha32 = weights.get(q).copy()
    base = load_file(lora_full.reference_dir / "base" / "model.safetensors")[q].numpy()
    # twice the scale, twice the delta (fp32 rounding aside)
    assert abs((alpha32 - base) - 2 * (alpha16 - base)).max() < 1e-5 and abs(alpha16 - base).max() > 1e-3


# ---- adapter output


def _peft_logits(base_dir, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return _logits(PeftModel.from_pretrained(base, adapter_dir), ids)


def test_lora_only_save_becomes_the_adapter_folder(cli, lora_only, tmp_path):
    target = tmp_path / "adapter"
    result = cli("merge", "--local_dir", lora_only.run_root, "--target_dir", target)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ref = load_file(lora_only.reference_dir / "lora_adapter" / "adapter_model.safetensors")
    ours = load_file(target / "adapter_model.safetensors")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (LORA_R, LORA_ALPHA, ["q_proj", "v_proj"])
    own = torch.load(lora_only.reference_dir / LOGITS_FILE, weights_only=True)
    torch.testing.assert_close(_peft_logits(lora_only.reference_dir / "base", target, own["input_ids"]), own["logits"],
                               atol=1e-5, rtol=1e-5)


def test_full_save_with_lora_adapter_writes_the_peft_folder(cli, lora_full, tmp_path):
    target = tmp_path / "adapter"
    result = cli("merge", "--local_dir", lora_full.run_root, "--target_dir", target, "--lora", "adapter")
    assert result.exit_code == 0, result.output
    ref = load_file(lora_full.reference_dir / "lora_adapter" / "adapter_model.safetensors")
    ours = load_file(target / "adapter_model.safetensors")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)
    own = torch.load(lora_full.reference_dir / LOGITS_FILE, weights_only=True)
    torch.testing.assert_close(_peft_logits(lora_full.reference_dir / "base", target, own["input_ids"]), own["logits"],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args, says", [
    (["--lora", "fuse"], "no base model to fuse into"),
    (["--lora", "both"], "no base model to fuse into"),
    (["--lora", "nonsense"], "choose one of"),
])
def test_impossible_lora_outputs_are_refused(cli, lora_only, tmp_path, args, says):
    result = cli("merge", "--local_dir", lora_only.run_root, "--target_dir", tmp_path / "out", *args)
    assert result.exit_code == 2 and says in result.stderr and not (tmp_path / "out").exists()


def test_lora_flag_on_a_plain_checkpoint_is_refused(cli, demo, tmp_path):
    result = cli("merge", "--local_dir", demo("fsdp2-w1").run_root, "--target_dir", tmp_path / "out", "--lora", "fuse")
    assert result.exit_code == 2 and "no LoRA adapter tensors" in result.stderr


# ---- the pipeline


def test_promote_publishes_the_fused_model_with_its_adapter(prefect_server, lora_full, tmp_path):
    from flows.promote import promote_checkpoint
    from mergecore.tensorio import HfWeights

    target = tmp_path / "model"
    promote_checkpoint(checkpoint=str(lora_full.run_root), target=str(target), dtype="fp32")
    ref = load_file(lora_full.reference_dir / "model.safetensors")
    with HfWeights(target) as ours:
        assert sorted(ours.names()) == sorted(ref)
        q = "model.layers.1.self_attn.v_proj.weight"
        torch.testing.assert_close(torch.from_numpy(ours.get(q).copy()), ref[q], atol=1e-6, rtol=1e-6)
    assert (target / "lora_adapter" / "adapter_model.safetensors").exists()
