"""Reading the chunks of a torch distributed checkpoint (DCP): each saved box of a tensor is a torch.save archive at
a byte range of a `.distcp` file, mapped as a numpy view (a remote file through a sparse range file), so only the
bytes of the boxes asked for are read, never another key's (optimizer state sharing the files).

Mixed into the DCP readers (Megatron dist_ckpt, `formats.dcp`): they set `dcp_dir` (the folder holding
`.metadata`), `metadata` (`dcp_metadata.load_dcp_metadata`) and `_tensor_keys` ({key: TensorStorageMetadata} of
the model's tensors).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from ..errors import CheckpointError
from ..storage import Location, RangeFile, fetch_ranges
from . import torchfile


class DcpChunks:
    dcp_dir: Location
    metadata: object
    _tensor_keys: dict[str, object]

    @cached_property
    def _chunk_files(self) -> dict[str, list[tuple[tuple, tuple, object]]]:
        """key -> [(chunk offsets, chunk sizes, its storage info: relative path, byte offset and length)]."""
        paths = {(index.fqn, tuple(index.offset or ())): info for index, info in self.metadata.storage_data.items()}
        out: dict[str, list] = {}
        for key, md in self._tensor_keys.items():
            for chunk in md.chunks:
                offsets = tuple(int(o) for o in chunk.offsets)
                info = paths[(key, offsets)]  # every chunk has one: `dcp_metadata._check_storage_index`
                out.setdefault(key, []).append((offsets, tuple(int(x) for x in chunk.sizes), info))
        return out

    def _overlapping_items(self, key: str, box_offsets, box_sizes):
        """(low, high, chunk offsets, chunk sizes, storage info) of each stored chunk of `key` overlapping the box;
        `low`/`high` are the overlap's global bounds."""
        for chunk_offsets, chunk_sizes, info in self._chunk_files.get(key, []):
            low = [max(b, c) for b, c in zip(box_offsets, chunk_offsets)]
            high = [min(b + n, c + m) for b, n, c, m in zip(box_offsets, box_sizes, chunk_offsets, chunk_sizes)]
            if all(lo < hi for lo, hi in zip(low, high)):
                yield low, high, chunk_offsets, chunk_sizes, info

    def _overlapping_chunks(self, key: str, box_offsets, box_sizes):
        """(low, high, mapped chunk, index of the overlap within it, chunk info) of each stored chunk of `key`
        overlapping the box."""
        for low, high, chunk_offsets, chunk_sizes, info in self._overlapping_items(key, box_offsets, box_sizes):
            if info.transform_descriptors:
                raise CheckpointError(
                    f"{self.dcp_dir.join(info.relative_path)}: {key} is stored through DCP extensions "
                    f"{list(info.transform_descriptors)} (compression?), which ckptflow does not read; save the "
                    "checkpoint without storage extensions")
            inside = tuple(slice(lo - c, hi - c) for lo, hi, c in zip(low, high, chunk_offsets))
            yield low, high, self._chunk_array(info, chunk_sizes), inside, info

    def _chunk_array(self, info, sizes: tuple[int, ...]) -> np.ndarray:
        """One stored chunk (a torch.save archive, DCP's default serialization) as a read-only numpy view of
        its mmapped .distcp file: pages are read when rows are asked for, and stay shared, never private."""
        key = (info.relative_path, info.offset)
        if key not in self._mapped_chunks:
            location = self.dcp_dir.join(info.relative_path)
            shown = f"{location} (bytes {info.offset}+{info.length})"
            try:
                array = torchfile.load(self._readable(info), shown, info.offset, info.length)
            except OSError as err:
                raise CheckpointError(f"{shown}: cannot be read ({err}); the file is missing or truncated: copy the "
                                      "whole checkpoint folder again") from None
            if not isinstance(array, np.ndarray) or tuple(array.shape) != tuple(sizes):
                raise CheckpointError(f"{shown}: holds {getattr(array, 'shape', type(array).__name__)}, not the "
                                      f"{tuple(sizes)} chunk .metadata describes; the folder mixes two saves")
            self._mapped_chunks[key] = array
        return self._mapped_chunks[key]

    @cached_property
    def _mapped_chunks(self) -> dict[tuple[str, int], np.ndarray]:
        return {}

    def _readable(self, info) -> str:
        """A local path holding the bytes of storage item `info`: a local .distcp file itself; for a remote one
        its sparse range file (`RangeFile`), with this item's bytes fetched unless they are already there."""
        location = self.dcp_dir.join(info.relative_path)
        if location.is_local:
            return location.local_file()
        remote = self._range_file(info.relative_path)
        remote.fetch([(info.offset, info.offset + info.length)])
        return remote.path

    def _range_file(self, relative_path: str) -> RangeFile:
        """The range file of a remote .distcp file; ranges are never joined across items that are not model
        tensors (optimizer state sharing the file, extra state)."""
        if relative_path not in self._range_files:
            remote = RangeFile.of(self.dcp_dir.join(relative_path))
            remote.keep_out((info.offset, info.offset + info.length) for index, info in self.metadata.storage_data.items()
                            if info.relative_path == relative_path and index.fqn not in self._tensor_keys)
            self._range_files[relative_path] = remote
        return self._range_files[relative_path]

    @cached_property
    def _range_files(self) -> dict[str, RangeFile]:
        return {}

    def _reads_remotely(self) -> bool:
        return not self.dcp_dir.is_local

    def _download_boxes(self, boxes) -> None:
        """The storage items of `boxes` ((key, box offsets, box sizes) each) from remote .distcp files, in one
        concurrent batch of range requests: whole items, each a torch.save archive of one saved box, never another
        key's (the optimizer's) items."""
        wanted: dict[RangeFile, list[tuple[int, int]]] = {}
        for key, offsets, sizes in boxes:
            for *_, info in self._overlapping_items(key, offsets, sizes):
                wanted.setdefault(self._range_file(info.relative_path), []).append((info.offset, info.offset + info.length))
        fetch_ranges(wanted)

    def _data_files(self) -> list[str]:
        """The `.distcp` files holding the model's tensors, by name."""
        return sorted({info.relative_path for chunks in self._chunk_files.values() for _, _, info in chunks})
