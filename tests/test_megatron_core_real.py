"""dist_ckpt folders written by real megatron-core on CPU (gloo): TP=1, TP=2, TP=2×PP=2, TP=2×PP=2×VPP=2,
and tied embeddings at TP=2×PP=2.

The TP=1 model's own parameters are the ground truth; the other layouts are that model loaded through
megatron-core's resharding load and saved again by TP*PP processes, as training at that layout saves.
The merged Hugging Face model must equal the parameters exactly and give Megatron's own logits.
Saving runs in subprocesses: importing megatron.core widens torch.load's weights_only allow-list for
the whole process, which would hide unpickling bugs in ours.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mergecore import merge_checkpoint, open_checkpoint
from mergecore.formats.megatron_dist import MegatronDistCheckpoint
from mergecore.megatron_maps import resolve, table_for
from mergecore.transforms import make_transform
from weights import load_folder

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install '.[megatron]')")
SAVER = Path(__file__).with_name("mcore_dist_save.py")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _megatron(*args) -> None:
    done = subprocess.run([sys.executable, str(SAVER), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """`saved(kind)` -> the role folder of a TP=1 save (dense: Qwen2-like; moe: Qwen2-MoE-like)."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(f"mcore-{kind}") / "global_step_3" / "actor"
            _megatron("save", out, _free_port(), kind)
            made[kind] = out
        return made[kind]

    return get


def expected_tensors(role: Path) -> dict[str, torch.Tensor]:
    """The saved model's own parameters under Hugging Face names (mapped at TP=1)."""
    params = torch.load(role / "params.pt", weights_only=True)
    config = json.loads((role / "huggingface" / "config.json").read_text())
    table, expected = table_for(config), {}
    for key, value in params.items():
        mapped = resolve(key, table)
        transform = make_transform(mapped.kind, config)
        expected.update(zip(mapped.hf_names(), (transform.merge([value])[part] for part in transform.parts)))
    return expected


def assert_logits_match(merged: Path, logits_file: Path) -> None:
    import transformers

    reference = torch.load(logits_file, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert torch.allclose(logits, reference["logits"], rtol=0, atol=1e-5), (logits - reference["logits"]).abs().max()


def merge_and_compare(role: Path, expected: dict, out: Path) -> None:
    source = open_checkpoint(str(role))
    assert isinstance(source, MegatronDistCheckpoint)
    source.validate()
    assert source.describe()["stacked_layers"] and source.describe()["layers"] == 4
    assert sorted(source.tensors()) == sorted(expected)  # tied: no lm_head, as Hugging Face stores it
    manifest = merge_checkpoint(str(role), out, dtype="keep")
    assert manifest["verification"][0]["ok"] and manifest["verification"][0]["tensors"] == len(expected)
    merged = load_folder(out)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_tp1_save_merges_to_the_models_own_parameters(saved, kind, tmp_path):
    role = saved(kind)
    assert open_checkpoint(str(role.parent.parent)).step == 3
    merge_and_compare(role, expected_tensors(role), tmp_path / "merged")
    if kind != "moe":  # Megatron's own forward runs on CPU for the local dense spec (not MoE: its kernels)
        assert_logits_match(tmp_path / "merged", role / "logits.pt")


@pytest.mark.parametrize("kind,tp,pp,vpp", [("dense", 2, 1, 1), ("dense", 2, 2, 1), ("dense", 2, 2, 2), ("tied", 2, 2, 1)],
                         ids=["tp2", "tp2-pp2", "tp2-pp2-vpp2", "tied-tp2-pp2"])
def test_parallel_saves_merge_to_the_same_model(saved, kind, tp, pp, vpp, tmp_path):
    """Tied embeddings under PP: the last stage's copy of the embedding is saved once, as the embedding."""
    base = saved(kind)
    role = tmp_path / "run" / "global_step_7" / "actor"
    _megatron("reshard", base, role, _free_port(), tp, pp, vpp, kind)
    assert len(list((role / "dist_ckpt").glob("*.distcp"))) >= tp * pp  # every rank wrote its pieces
    merge_and_compare(role, expected_tensors(base), tmp_path / "merged")
    assert_logits_match(tmp_path / "merged", base / "logits.pt")
    if pp == 1:  # the TP-parallel forward of the saved layout itself
        assert_logits_match(tmp_path / "merged", role / "logits.pt")
