"""Tests read merged folders with safetensors' own torch loader, independent of mergecore's reader."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file


def load_folder(folder: str | Path) -> dict:
    """Every tensor of a Hugging Face folder's *.safetensors files, as torch tensors."""
    state = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(file))
    assert state, f"{folder}: no safetensors files"
    return state


def assert_cast_of(folder: str | Path, reference_dir: str | Path, dtype) -> None:
    """`folder` holds exactly the reference's tensors (names from save_pretrained), each cast to `dtype`."""
    import torch

    weights, reference = load_folder(folder), load_folder(reference_dir)
    assert sorted(weights) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor.to(dtype)), name
