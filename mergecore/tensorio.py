"""Reading Hugging Face folders back, tensor by tensor, as numpy arrays."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .arrays import from_safetensors_dtype, numpy_dtype, to_numpy
from .errors import CheckpointError

__all__ = ["HfWeights", "SafetensorsFile", "read_json"]


class SafetensorsFile:
    """A .safetensors file mmapped: `get_tensor` returns a read-only numpy view, nothing is copied.

    (safetensors' own numpy loader copies each tensor; verification reads every byte, so views pay.)

    >>> SafetensorsFile("model-00001-of-00002.safetensors").get_tensor("model.norm.weight").dtype  # doctest: +SKIP
    dtype(bfloat16)

    The mapping closes when the last view of it goes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            length = int.from_bytes(self._raw[:8], "little")
            header = json.loads(self._raw[8:8 + length])
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{self.path}: not a safetensors file ({err}); merge again") from None
        self._start = 8 + length
        self._entries = {k: v for k, v in header.items() if k != "__metadata__"}

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = numpy_dtype(from_safetensors_dtype(entry["dtype"]))
        begin, end = entry["data_offsets"]
        flat = np.frombuffer(self._raw, dtype, count=(end - begin) // dtype.itemsize, offset=self._start + begin)
        return flat.reshape(entry["shape"])


class HfWeights:
    """The weights of a Hugging Face folder (sharded or single safetensors, or pytorch .bin).

    >>> with HfWeights("out/model") as weights:          # doctest: +SKIP
    ...     weights.get("model.norm.weight").shape
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._where: dict[str, object] = {}

    def __enter__(self) -> HfWeights:
        files = sorted(self.folder.glob("*.safetensors"))
        for file in files:
            handle = SafetensorsFile(file)
            for name in handle.keys():
                self._where[name] = handle
        if not files:
            for file in sorted(self.folder.glob("pytorch_model*.bin")):
                import torch

                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                self._where.update({name: state for name in state})
        if not self._where:
            raise CheckpointError(f"{self.folder}: no *.safetensors or pytorch_model*.bin weights found")
        return self

    def __exit__(self, *exc) -> None:
        self._where.clear()  # files unmap once the views handed out are gone too

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> np.ndarray:
        holder = self._where[name]
        return to_numpy(holder[name]) if isinstance(holder, dict) else holder.get_tensor(name)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
