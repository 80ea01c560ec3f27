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
