"""`ckptflow inspect` names the family, how the names a merge writes were derived, and the saved tensors nothing
places: on real FSDP checkpoints (the `demo` fixture) and on one whose family nobody knows. Expected names come from
the rank files themselves and the `save_pretrained` reference folder."""

from __future__ import annotations

import json

import torch
from conftest import copy_run
from safetensors import safe_open


def saved_names(ckpt) -> set[str]:
    """The parameter names in rank 0's file, as training saved them."""
    rank0 = next(ckpt.role_dir.glob("model_world_size_*_rank_0.pt"))
    import torch.distributed.tensor  # noqa: F401 - DTensor values unpickle with it

    return set(torch.load(rank0, map_location="cpu", weights_only=True, mmap=True))


def hub_names(folder) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "np") as f:
            names |= set(f.keys())
    return names


def test_inspect_names_a_registered_family_and_transformers_conversion(cli, demo):
    result = cli("inspect", demo("fsdp2-w2").run_root)
    assert result.exit_code == 0, result.output
    assert "family: qwen2 (registered); layout: registry" in result.stdout
    assert "cannot place" not in result.stdout
    moe = demo("qwen3_moe")
    assert saved_names(moe) != hub_names(moe.reference_dir)  # packed experts in memory: a conversion is needed
    report = json.loads(cli("inspect", moe.role_dir, "--json").stdout)
    assert report["family"]["model_type"] == "qwen3_moe"
    assert report["family"]["layout"] == "transformers' conversion"
    assert report["family"]["unplaced"] == []


def test_inspect_of_an_unknown_family_lists_the_tensors_it_cannot_place(cli, demo, tmp_path):
    ckpt = copy_run(demo("qwen3_moe"), tmp_path / "acme")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "acme_moe",
                                       "architectures": ["AcmeMoeForCausalLM"]}))
    report = json.loads(cli("inspect", ckpt.role_dir, "--json").stdout)
    family = report["family"]
    assert (family["model_type"], family["registered"], family["layout"]) == ("acme_moe", False, "as saved")
    # what nothing places: the saved names save_pretrained does not write (the packed experts)
    assert set(family["unplaced"]) == saved_names(ckpt) - hub_names(ckpt.reference_dir)
    assert family["unplaced"]
    result = cli("inspect", ckpt.role_dir)
    assert result.exit_code == 0, result.output
    assert "family: acme_moe (not registered); layout: as saved" in result.stdout
    assert f"cannot place {len(family['unplaced'])} tensors: model.layers.0.mlp.experts." in result.stdout
    assert "register the family" in result.stdout
