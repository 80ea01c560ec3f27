"""`ckptflow merge --quantize` from the other input formats: Megatron (dist_ckpt and legacy rank files) and a verl
FSDP LoRA checkpoint fused then quantized. FSDP2 dense and MoE: test_quantize.py.

Expected values come from elsewhere: the Megatron model's own parameters (params.pt of a real megatron-core save,
mapped to Hugging Face names by tests/mcore_real.py's own table), peft's `merge_and_unload()` of the trained LoRA
model, compressed-tensors' own packer, and transformers' quantized loaders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_real import STEP, hf_tensors, needs_megatron, tp1_save
from quantized_checks import assert_decodes_within_bound, assert_packed_as_compressed_tensors, folder_tensors
from weights import load_folder

pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")

SCHEMES = ("fp8-block", "w8a16", "w4a16")
MEGATRON_LINEARS = 4 * 7  # 4 layers x (q, k, v, o, gate, up, down)


@pytest.fixture(scope="session")
def megatron(tmp_path_factory) -> dict:
    """{"dist_ckpt": role, "legacy": role, "trained": HF tensors, "reference": save_pretrained folder} of one real
    megatron-core model (hidden 128, ffn 256): its TP=1 dist_ckpt save, and legacy rank files at TP=2 x PP=2 cut
    from its parameters (a real TP=2 save would cost ~25 s more; test_megatron_core_real.py proves those layouts)."""
    role = tp1_save(tmp_path_factory, "quant")
    trained = hf_tensors(role)
    config = json.loads((role / "huggingface" / "config.json").read_text())
    root = tmp_path_factory.mktemp("mcore-quant-legacy")
    return {"dist_ckpt": role, "legacy": legacy_rank_files(trained, config, role / "huggingface", root),
            "trained": trained, "reference": saved_by_transformers(trained, config, root / "reference")}


def legacy_rank_files(trained: dict, config: dict, hf_dir: Path, root: Path, tp: int = 2, pp: int = 2) -> Path:
    """verl's legacy layout (model/mp_rank_TT_PPP/model.pt, a list of per-stage state dicts) of `trained`."""
    from ckptflow.testing.megatron_fixtures import reshard

    role = root / f"global_step_{STEP}" / "actor"
    for (t, p), chunks in reshard(trained, config, tp, pp).items():
        folder = role / "model" / f"mp_rank_{t:02d}_{p:03d}"
        folder.mkdir(parents=True)
        torch.save(chunks, folder / "model.pt")
    shutil.copytree(hf_dir, role / "huggingface")
    (root / "latest_checkpointed_iteration.txt").write_text(str(STEP))
    return role


def saved_by_transformers(trained: dict, config: dict, into: Path) -> Path:
    """The unquantized model as transformers saves it: the reference of the logits check."""
    import transformers

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    missing, unexpected = model.load_state_dict(trained, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(trained)
    model.save_pretrained(into)
    return into


def merged(cli, source: Path, target: Path, scheme: str, *options) -> Path:
    result = cli("merge", "--local-dir", source, "--target-dir", target, "--quantize", scheme, *options)
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / "ckptflow_manifest.json").read_text())
    [trip] = [c for c in manifest["verification"] if c["check"] == "round-trip"]
    assert trip["ok"] and trip["scheme"] == scheme and 0 < trip["max_error_vs_bound"] <= 1
    return target


@needs_megatron
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout, dtype", [("dist_ckpt", "keep"), ("legacy", "bf16")])
def test_megatron_quantized_decodes_within_bound_of_its_parameters(megatron, cli, tmp_path, monkeypatch, layout,
                                                                    dtype, scheme):
    """dist_ckpt in fp32 (scales fp32), legacy TP2xPP2 to bf16 (scales bf16), read in 128-row bands (a band of
    gate_proj lies on one TP rank, the next on the other): every Linear of the decoder quantized, within the bound
    of the model's own parameters; embeddings, norms, biases and the head as trained; int schemes bit for bit
    compressed-tensors' own quantization and packing; `ckptflow verify` proves it again."""
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", str(128 * 256 * 4 * 3))  # one 128-row band of the widest weight
    out = merged(cli, megatron[layout], tmp_path / "out", scheme, "--dtype", dtype)
    torch_dtype = torch.float32 if dtype == "keep" else torch.bfloat16
    assert assert_decodes_within_bound(out, megatron["trained"], scheme, torch_dtype) == MEGATRON_LINEARS
    if scheme != "fp8-block":
        assert assert_packed_as_compressed_tensors(out, megatron["trained"], scheme) == MEGATRON_LINEARS
    verified = cli("verify", out)
    assert verified.exit_code == 0, verified.output


@needs_megatron
@pytest.mark.parametrize("scheme", SCHEMES)
def test_megatron_quantized_loads_in_transformers_close_to_the_model(megatron, cli, tmp_path, scheme):
    """transformers' own quantized loader finds every key of the dist_ckpt export, and its logits stay within the
    scheme's mean-KL threshold of the unquantized model (saved by transformers from the model's parameters)."""
    from mergecore.proofs.verify import reference_checks

    out = merged(cli, megatron["dist_ckpt"], tmp_path / "out", scheme)
    [result] = reference_checks(out, megatron["reference"])
    assert result["ok"] and result["check"] == "logits (quantized)"
    assert result["mean_kl"] <= result["kl_max"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lora_fused_then_quantized_decodes_within_bound_of_peft_merge(demo, cli, tmp_path, scheme):
    """A verl FSDP2 LoRA checkpoint: the adapters are fused first, then quantized: q_proj and v_proj decode within
    the bound of peft's `merge_and_unload()` weights (reference/), not of the base weights; the adapter written
    beside it is peft's own."""
    pytest.importorskip("peft")
    ckpt = demo("quant-lora")
    out = merged(cli, ckpt.run_root, tmp_path / "out", scheme)
    fused = load_folder(ckpt.reference_dir)
    assert assert_decodes_within_bound(out, fused, scheme, torch.bfloat16) == 2 * 7
    base = load_folder(ckpt.reference_dir / "base")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    # the adapter moved it far past every scheme's bound: quantizing the base weights instead would fail above
    assert (fused[q_proj] - base[q_proj]).abs().mean() > 0.04
    if scheme != "fp8-block":
        assert assert_packed_as_compressed_tensors(out, fused, scheme) == 2 * 7
    adapter = folder_tensors(out / "lora_adapter")
    assert adapter and all(".lora_" in name for name in adapter)


@pytest.mark.parametrize("fixture, options, fix", [
    ("quant-lora", ("--lora", "adapter"), "use --lora fuse or both"),
    ("lora-only", (), "pass --base-model PATH_OR_REPO to fuse it"),  # save_lora_only: the adapter is all it can write
], ids=["lora-adapter", "save-lora-only"])
def test_quantize_with_an_adapter_only_output_is_one_line_and_writes_nothing(demo, cli, tmp_path, fixture, options,
                                                                             fix):
    """Only a fused model is quantized: an adapter-only LoRA output with --quantize was written unquantized, exit 0."""
    pytest.importorskip("peft")
    result = cli("merge", "--local-dir", demo(fixture).run_root, "--target-dir", tmp_path / "out", "--quantize",
                 "w4a16", *options)
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "--quantize w4a16 quantizes a fused model" in line and fix in line
    assert not (tmp_path / "out").exists()
