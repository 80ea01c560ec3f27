"""The base model of a save_lora_only checkpoint (`--base-model`): a local Hugging Face folder or a Hub repo id,
its safetensors weights read as a checkpoint of one piece per tensor (never pickles): the weights the fused LoRA
view (`views/lora.py`) adds the adapter to.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

from ..errors import CheckpointError
from ..storage import Location
from .base import CheckpointSource, Piece, TensorInfo

BASE_FILES = ("*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")  # never pickles (*.bin, *.pt)


def base_model_folder(spec: str) -> Path:
    """A local Hugging Face folder, or a Hub repo id downloaded (safetensors and metadata only) with
    huggingface_hub, which honours HF_ENDPOINT, HF_TOKEN and its cache.

    >>> base_model_folder("Qwen/Qwen2.5-0.5B")  # doctest: +SKIP
    PosixPath('~/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/...')
    """
    local = Path(spec).expanduser()
    if local.is_dir():
        folder = local
    elif local.exists() or spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise CheckpointError(f"--base-model {spec}: not a folder nor a Hub repo id (org/name); pass the base model's "
                              "folder or repo id")
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        try:
            folder = Path(snapshot_download(spec, allow_patterns=list(BASE_FILES)))
        except RepositoryNotFoundError:
            raise CheckpointError(f"--base-model {spec}: no such Hub repo (or no access: set HF_TOKEN); pass the "
                                  "base model's folder or repo id") from None
        except (HfHubHTTPError, OSError) as err:
            reason = " ".join(str(err).split())[:160]
            raise CheckpointError(f"--base-model {spec}: download failed ({reason}); check HF_ENDPOINT/HF_TOKEN "
                                  "or pass a local folder") from None
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"--base-model {spec}: no *.safetensors weights (pickled .bin weights are never "
                              "loaded); convert the base model to safetensors")
    return folder


class BaseModelSource(CheckpointSource):
    """The weights of a Hugging Face folder (safetensors only) as a checkpoint of one piece per tensor,
    each a view of the mmapped file (read per tensor, like every merge)."""

    format_name = "hf-folder"

    def __init__(self, spec: str):
        from ..storage.tensorio import HfWeights

        self.spec = spec
        self.folder = base_model_folder(spec)
        self.location = self.hf_dir = Location.of(str(self.folder))
        self._weights = HfWeights(self.folder).__enter__()  # mmapped for the life of this source

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        from ..numbers.arrays import dtype_of

        infos = {}
        for name in self._weights.names():
            value = self._weights.get(name)
            infos[name] = TensorInfo(name, tuple(value.shape), dtype_of(value), "plain")
        return infos

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def pieces(self, name: str) -> Iterator[Piece]:
        value = self._weights.get(name)
        yield Piece(f"{self.folder}", (0,) * value.ndim, tuple(value.shape), value)

    def validate(self, check_replicas: bool = False) -> None:
        pass  # a safetensors folder is one consistent file set (HfWeights checked its index)

    def input_files(self, names=None) -> list:
        return [Location.of(str(p)) for p in sorted(self.folder.glob("*.safetensors"))]

    def describe(self) -> dict:
        return {"format": self.format_name, "location": str(self.folder), "base_model": self.spec}
