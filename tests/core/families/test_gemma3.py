"""Gemma 3 text (`Gemma3ForCausalLM`, tied embeddings as Gemma ships, q/k norms, four norms per layer, sliding
and full attention layers): a real FSDP2 checkpoint merges to exactly what save_pretrained writes and gives the
trained model's own logits."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM

from ckptflow.testing.demo_checkpoint import LOGITS_FILE
from mergecore import compare_logits, merge_checkpoint
from weights import load_folder


@pytest.fixture(scope="session")
def gemma(demo):
    return demo("gemma3_text")


def test_gemma3_merges_to_save_pretrained_files_and_own_logits(gemma, tmp_path):
    out = tmp_path / "out"
    manifest = merge_checkpoint(str(gemma.role_dir), out, dtype="keep")
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    weights, reference = load_folder(out), load_folder(gemma.reference_dir)
    assert sorted(weights) == sorted(reference) and "lm_head.weight" not in weights  # stored once, as Gemma ships
    assert "model.layers.1.pre_feedforward_layernorm.weight" in weights
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name

    own = torch.load(gemma.reference_dir / LOGITS_FILE, weights_only=True)
    model = Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=own["input_ids"]).logits
    torch.testing.assert_close(logits, own["logits"], atol=1e-5, rtol=1e-5)
    assert compare_logits(out, gemma.reference_dir)["max_abs_diff"] == 0.0
