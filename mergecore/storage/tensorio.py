"""Reading Hugging Face folders back, tensor by tensor, as numpy arrays."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..numbers.arrays import from_safetensors_dtype, numpy_dtype, to_numpy
from ..errors import CheckpointError

__all__ = ["HfWeights", "SafetensorsFile", "read_json"]

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def read_weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's `weight_map` (tensor name -> file name), each file in the index's own folder."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and "/" not in f and f not in ("", ".", "..")
                                                    for f in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map is not a mapping of tensor names to file names in this folder; "
                              "restore the index")
    return weight_map


class SafetensorsFile:
    """A .safetensors file mmapped: `get_tensor` returns a read-only numpy view, nothing is copied.

    (safetensors' own numpy loader copies each tensor; verification reads every byte, so views pay.)

    >>> SafetensorsFile("model-00001-of-00002.safetensors").get_tensor("model.norm.weight").dtype  # doctest: +SKIP
    dtype('uint16')

    (a BF16 tensor comes back as its bits: `arrays.dtype_of` names it "bfloat16", `arrays.cast` converts it)

    The mapping closes when the last view of it goes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
            length = int.from_bytes(self._raw[:8], "little")
            if len(self._raw) < 8 or 8 + length > len(self._raw):
                raise ValueError("the header runs past the end of the file")
            header = json.loads(self._raw[8:8 + length])
            self._start = 8 + length
            self._entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for name, entry in self._entries.items():
                self._check(name, entry)
        except (ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{self.path}: not a valid safetensors file ({str(err).splitlines()[0]}); "
                                  "copy or merge it again") from None

    def _check(self, name: str, entry: dict) -> None:
        """Each tensor's bytes lie inside the file and match its shape and dtype."""
        begin, end = entry["data_offsets"]
        count = 1
        for size in entry["shape"]:
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"tensor {name} has shape {entry['shape']}")
            count *= size
        itemsize = numpy_dtype(from_safetensors_dtype(entry["dtype"])).itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
                and self._start + end <= len(self._raw) and end - begin == count * itemsize):
            raise ValueError(f"tensor {name}'s bytes {begin}..{end} do not fit the file or its shape")

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = numpy_dtype(from_safetensors_dtype(entry["dtype"]))
        begin, end = entry["data_offsets"]
        flat = np.frombuffer(self._raw, dtype, count=(end - begin) // dtype.itemsize, offset=self._start + begin)
        return flat.reshape(entry["shape"])


class HfWeights:
    """The weights of a Hugging Face folder, found through its index (or its only weight file).

    Strict, because a folder with stray or shadowed weights is not the model its index describes:
    every file the index names must hold exactly the tensors mapped to it, and no other weight file
    may sit beside them. Without an index, the folder must hold one `.safetensors` or `.bin` file.

    >>> with HfWeights("out/model") as weights:          # doctest: +SKIP
    ...     weights.get("model.norm.weight").shape
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._where: dict[str, object] = {}

    def __enter__(self) -> HfWeights:
        on_disk = sorted(p.name for p in self.folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        index = next((self.folder / name for name in INDEX_FILES if (self.folder / name).exists()), None)
        if index is not None:
            weight_map = read_weight_map(index)
            unnamed = sorted(set(on_disk) - set(weight_map.values()))
            if unnamed:
                raise CheckpointError(f"{self.folder / unnamed[0]}: a weight file that {index.name} does not name; "
                                      "remove it (it is not part of this model)")
            for file in sorted(set(weight_map.values())):
                self._add(self.folder / file, expected={n for n, f in weight_map.items() if f == file}, index=index)
        elif len(on_disk) == 1:
            self._add(self.folder / on_disk[0])
        elif on_disk:
            raise CheckpointError(f"{self.folder}: {len(on_disk)} weight files and no index; "
                                  "keep the model.safetensors.index.json that names them")
        if not self._where:
            raise CheckpointError(f"{self.folder}: no *.safetensors or pytorch_model*.bin weights found")
        return self

    def _add(self, path: Path, expected: set[str] | None = None, index: Path | None = None) -> None:
        if not path.is_file():
            raise CheckpointError(f"{path}: named by {index.name if index else 'the index'} but missing; the folder is incomplete")
        if path.suffix == ".bin":
            import torch

            try:
                holder = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # noqa: BLE001 - any unreadable file is bad input
                raise CheckpointError(f"{path}: cannot be read as weights ({str(err).splitlines()[0]})") from None
            names = list(holder)
        else:
            holder = SafetensorsFile(path)
            names = holder.keys()
        if expected is not None and set(names) != expected:
            odd = sorted(set(names) ^ expected)
            raise CheckpointError(f"{path}: holds other tensors than {index.name} maps to it ({', '.join(odd[:3])}); "
                                  "the folder was changed after it was written: merge again")
        self._where.update({name: holder for name in names})

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


def read_json(path, fix: str = "restore it from where it came") -> dict:
    """A JSON object from a file (a `Path` or `storage.Location`); anything else is a one-line CheckpointError."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {fix}") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and an integer too long to convert
        raise CheckpointError(f"{path}: not valid JSON ({(str(err).splitlines() or [''])[0][:120]}); {fix}") from None
    except RecursionError:  # nested deeper than the parser's stack
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply); {fix}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}, not an object; {fix}")
    return value
