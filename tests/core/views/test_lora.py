"""LoRA checkpoints from verl FSDP: peft wraps the model before FSDP2 (full saves and save_lora_only).

Expected values come from the trained PEFT model itself: its own forward (reference/logits.pt), its
`save_pretrained` (reference/lora_adapter/) and `merge_and_unload().save_pretrained` (reference/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptflow.testing.demo_checkpoint import LOGITS_FILE, LORA_ALPHA, LORA_R
from helpers import cli_in_fresh_process

pytest.importorskip("peft")


@pytest.fixture(scope="session")
def lora_full(demo):
    return demo("lora-full")


@pytest.fixture(scope="session")
def lora_only(demo):
    return demo("lora-only")


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

    from ckptflow.flows.cli import app

    target = tmp_path_factory.mktemp("fused") / "model"
    result = CliRunner().invoke(app, ["merge", "--local_dir", str(lora_full.run_root), "--target_dir", str(target),
                                      "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    return target


def test_fused_tensors_stream_in_row_blocks_to_the_same_bytes(lora_full, tmp_path):
    """A fused tensor is written in row blocks within the memory budget, and the bytes do not depend on the
    blocking (the round-trip check rebuilds each block bit for bit)."""
    from mergecore import merge_checkpoint, open_checkpoint
    from mergecore.engine.merge import merge_view

    outputs = {}
    for budget in (0, 4096):
        outputs[budget] = tmp_path / f"budget-{budget}"
        merge_checkpoint(str(lora_full.role_dir), outputs[budget], dtype="bf16", chunk_bytes=budget)
    weights = sorted(p.name for p in outputs[0].glob("*.safetensors"))
    assert weights and all((outputs[0] / w).read_bytes() == (outputs[4096] / w).read_bytes() for w in weights)
    source = merge_view(open_checkpoint(str(lora_full.role_dir)), None)
    blocks = list(source.row_blocks("model.layers.0.self_attn.q_proj.weight", "bfloat16", 4096))
    assert len(blocks) > 1 and source.adapted("model.layers.0.self_attn.q_proj.weight")


def test_fused_tensors_equal_merge_and_unload(fused, lora_full):
    from mergecore.storage.tensorio import HfWeights

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
    from mergecore.storage.tensorio import HfWeights

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


# ---- the order of views: LoRA first (HF names), then the Hub's layout on those names


def test_dense_lora_merge_asks_transformers_once_per_config(lora_full, tmp_path):
    """The Hub layout is asked of transformers only for names that are not the Hub's (a dense LoRA merge's fused
    names are); the config check asks it always (every family is checked against transformers' own model), in a
    child process the first time, and its answer is kept per config.json and transformers install: neither merge
    imports torch or transformers (they cost seconds and ~240 MiB), and one answer is kept."""
    imported = []
    for target in (tmp_path / "first", tmp_path / "second"):
        run, said = cli_in_fresh_process("merge", "--local_dir", lora_full.run_root, "--target_dir", target,
                                         config_cache=tmp_path / "cache")
        assert run.returncode == 0, run.stderr
        assert (target / "lora_adapter" / "adapter_model.safetensors").exists()
        imported.append(said)
    assert imported == ["imported: []", "imported: []"]
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1


@pytest.fixture(scope="session")
def lora_moe(demo):
    return demo("lora-moe")


def test_moe_lora_merges_to_merge_and_unloads_hub_layout(cli, lora_moe, tmp_path):
    """Qwen3-MoE with LoRA on attention: the packed experts come out per expert, as merge_and_unload().save_pretrained
    writes them, and the fused model gives the PEFT model's own logits."""
    from transformers import AutoModelForCausalLM

    from mergecore.storage.tensorio import HfWeights

    names = _rank0_names(lora_moe)
    assert "base_model.model.model.layers.0.mlp.experts.gate_up_proj" in names  # packed in the rank files
    target = tmp_path / "model"
    result = cli("merge", "--local_dir", lora_moe.run_root, "--target_dir", target, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    ref = load_file(lora_moe.reference_dir / "model.safetensors")
    with HfWeights(target) as ours:
        assert sorted(ours.names()) == sorted(ref)
        for name, expected in ref.items():
            got = torch.from_numpy(ours.get(name).copy())
            assert got.shape == expected.shape, name
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    own = torch.load(lora_moe.reference_dir / LOGITS_FILE, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.testing.assert_close(_logits(model, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)
    verified = cli("verify", target)
    assert verified.exit_code == 0, verified.output
    # per expert weight 1 piece (4 experts Shard(0) over 2 ranks: each lives on one rank): 2 layers x 4 experts x
    # 3 = 24; every other tensor 2 pieces: 21 tensors = 42; plus A and B (2 pieces each) of 4 adapted weights = 16
    assert "pieces=82" in verified.stdout.replace(" ", "")


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


# ---- save_lora_only fused into --base-model


def _check_fused(target, demo):
    from mergecore.storage.tensorio import HfWeights

    ref = load_file(demo.reference_dir / "model.safetensors")  # merge_and_unload().save_pretrained
    with HfWeights(target) as ours:
        assert sorted(ours.names()) == sorted(ref)
        for name, expected in ref.items():
            torch.testing.assert_close(torch.from_numpy(ours.get(name).copy()), expected, atol=1e-6, rtol=1e-6)


def test_lora_only_save_fuses_into_a_local_base_model(cli, lora_only, tmp_path):
    from transformers import AutoModelForCausalLM

    target = tmp_path / "model"
    result = cli("merge", "--local_dir", lora_only.run_root, "--target_dir", target, "--dtype", "fp32",
                 "--base-model", lora_only.reference_dir / "base")
    assert result.exit_code == 0, result.output
    _check_fused(target, lora_only)
    card = (target / "README.md").read_text()
    assert "| LoRA base model | base " in card and str(lora_only.reference_dir) not in card  # named, never its path
    own = torch.load(lora_only.reference_dir / LOGITS_FILE, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.testing.assert_close(_logits(model, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)
    ref = load_file(lora_only.reference_dir / "lora_adapter" / "adapter_model.safetensors")
    ours = load_file(target / "lora_adapter" / "adapter_model.safetensors")  # --lora both by default
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)
    verified = cli("verify", target)  # reopens the base model from the manifest: base pieces + A and B pieces
    # 27 tensors, one piece each in the base folder; A and B (2 ranks each) of 4 adapted weights
    assert verified.exit_code == 0 and "pieces=43" in verified.stdout.replace(" ", ""), verified.output


def test_lora_only_save_fuses_into_a_base_model_on_the_hub(cli, hub, lora_only, tmp_path):
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo("alice/base")
    api.upload_folder(repo_id="alice/base", folder_path=str(lora_only.reference_dir / "base"))
    target = tmp_path / "model"
    result = cli("merge", "--local_dir", lora_only.run_root, "--target_dir", target, "--dtype", "fp32",
                 "--base-model", "alice/base", "--lora", "fuse")
    assert result.exit_code == 0, result.output
    _check_fused(target, lora_only)
    assert not (target / "lora_adapter").exists()
    downloads = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert any(p.endswith("model.safetensors") for p in downloads)


def test_base_model_of_other_shapes_is_refused(cli, lora_only, tmp_path):
    import shutil

    from safetensors.torch import save_file

    base = tmp_path / "other-base"
    shutil.copytree(lora_only.reference_dir / "base", base)
    weights = load_file(base / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    weights[q] = weights[q][:32].clone()
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    result = cli("merge", "--local_dir", lora_only.run_root, "--target_dir", tmp_path / "out", "--base-model", base)
    assert result.exit_code == 2 and "--base-model" in result.stderr and q in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, says", [
    (["--lora", "fuse"], "pass --base-model"),
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
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest
    from mergecore.storage.tensorio import HfWeights

    target = tmp_path / "model"
    promote_checkpoint(PromotionRequest.of(str(lora_full.run_root), str(target), dtype="fp32"))
    ref = load_file(lora_full.reference_dir / "model.safetensors")
    with HfWeights(target) as ours:
        assert sorted(ours.names()) == sorted(ref)
        q = "model.layers.1.self_attn.v_proj.weight"
        torch.testing.assert_close(torch.from_numpy(ours.get(q).copy()), ref[q], atol=1e-6, rtol=1e-6)
    assert (target / "lora_adapter" / "adapter_model.safetensors").exists()


def test_promote_pushes_the_fused_model_and_its_adapter_to_one_repo(prefect_server, hub, lora_full, tmp_path):
    from huggingface_hub import snapshot_download
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest

    target = tmp_path / "model"
    result = promote_checkpoint(PromotionRequest.of(str(lora_full.run_root), str(target), dtype="fp32",
                                                    hub={"repo": "alice/lora-model", "revision": "step-1"},
                                                    lora={"alpha": 16.0}))
    assert result["hub"]["revision"] == "step-1"
    files = hub.files("alice/lora-model", revision="step-1")
    fused = load_file(lora_full.reference_dir / "model.safetensors")
    weights = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    assert weights and files[weights[0]] == (target / weights[0]).read_bytes()
    assert {"lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors"} <= set(files)
    card = files["README.md"].decode()
    assert "r=8, alpha=16.0 into q_proj, v_proj" in card and "--lora-alpha" in card and "`lora_adapter/`" in card

    own = torch.load(lora_full.reference_dir / LOGITS_FILE, weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(lora_full.reference_dir / "base", dtype=torch.float32)
    # peft's own Hub lookup ignores a patched endpoint, so fetch the revision as users of a mirror would
    local = Path(snapshot_download("alice/lora-model", revision="step-1"))
    peft_model = PeftModel.from_pretrained(base, local / "lora_adapter")
    torch.testing.assert_close(_logits(peft_model, own["input_ids"]), own["logits"], atol=1e-5, rtol=1e-5)
    pushed = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    torch.testing.assert_close(pushed.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                               fused["model.layers.0.self_attn.q_proj.weight"], atol=1e-6, rtol=1e-6)


def test_promote_refuses_an_adapter_only_output(prefect_server, cli, lora_only, tmp_path):
    result = cli("promote", lora_only.run_root, "--target", tmp_path / "out")
    assert result.exit_code == 2 and "--base-model" in result.stderr and not (tmp_path / "out").exists()
