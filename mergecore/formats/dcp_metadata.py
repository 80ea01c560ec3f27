"""A torch distributed checkpoint's `.metadata` (Megatron dist_ckpt, torchtitan, Accelerate, `dcp.save`): DCP's
pickled `Metadata` (global shapes, saved chunks, where their bytes are), loaded as inert records and bounded by the bytes the folder really holds, before the reader builds anything.

`.metadata` is untrusted: it is unpickled with an allow-list (`untrusted.DCP_METADATA`), never with plain pickle
(torch's `FileSystemReader.read_metadata` uses plain `pickle.load`, so it is bypassed). Every count it claims is
checked against the data files (`numbers.claims`), and every data file it names must lie inside the folder.
"""

from __future__ import annotations

import io
import math
import os
import posixpath

from ..errors import CheckpointError
from ..numbers.arrays import element_size
from ..numbers.claims import Extent, overclaimed, places
from ..storage import Location
from .untrusted import DCP_METADATA, DCP_RECORDS, AllowListUnpickler, Refused, check_plain_fields

__all__ = ["load_dcp_metadata"]


def load_dcp_metadata(location: Location):
    """The DCP `Metadata` of a `.metadata` file as inert records (`untrusted.DCP_METADATA`: torch is not
    imported; dtypes are names, sizes tuples), with its storage index checked (`_check_storage_index`);
    one-line errors."""
    Metadata = DCP_RECORDS["Metadata"]
    if not location.exists():
        raise CheckpointError(
            f"{location}: missing; the distributed checkpoint's save was incomplete (every rank writes its .distcp file, then rank 0 "
            "writes .metadata): copy the whole checkpoint folder again"
        )
    try:
        with location.open("rb") as f:
            data = f.read()
        metadata = AllowListUnpickler(io.BytesIO(data), DCP_METADATA, file_bytes=len(data),
                                      what="a DCP .metadata").load()
        check_plain_fields(metadata, "a DCP .metadata")
    except Refused as err:
        raise CheckpointError(
            f"{location}: refused to unpickle ({str(err).splitlines()[0]}); ckptflow only loads checkpoint metadata, "
            "never arbitrary objects"
        ) from None
    except Exception as err:  # noqa: BLE001 - truncated or garbage file
        raise CheckpointError(
            f"{location}: cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); the "
            "file is truncated or not a torch distributed checkpoint: copy it again"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{location}: holds a {type(metadata).__name__}, not a torch distributed checkpoint Metadata")
    if not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{location}: has no storage index (storage_data); it was not written by FileSystemWriter")
    _check_storage_index(metadata, location)
    return metadata


def _check_storage_index(metadata, location: Location) -> None:
    """Every count the metadata claims is bounded by the bytes the checkpoint folder really holds, before the reader
    builds anything from it (`numbers.claims`): each storage item names a present data file inside the folder and
    bytes of its own inside that file; each tensor chunk has its own storage item, lies inside its tensor and fits
    in its item's bytes; a tensor's chunks hold all its elements, and its shape claims no more places than the data
    files have bytes (a `[10**12, 0]` stacked key would otherwise make 10**12 layer slices of nothing)."""
    _StorageInfo, MetadataIndex = DCP_RECORDS["_StorageInfo"], DCP_RECORDS["MetadataIndex"]
    TensorStorageMetadata = DCP_RECORDS["TensorStorageMetadata"]

    def refuse(what: str):
        raise CheckpointError(f"{location}: {what}; the metadata is damaged or was tampered with: copy the dist_ckpt "
                              "folder again from where training saved it")

    def counts(values, what: str) -> tuple[int, ...]:
        values = tuple(values or ())
        if not all(type(v) is int and v >= 0 for v in values):
            refuse(f"{what} {values} is not a list of non-negative integers")
        return values

    folder, data_files = location.parent, {}
    items: dict[tuple[str, tuple], _StorageInfo] = {}
    extents = []
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            refuse(f"storage index entry {type(index).__name__} -> {type(info).__name__} is not a DCP storage entry")
        if not isinstance(info.relative_path, str) or info.relative_path not in data_files:  # refused unless a str
            data_files[info.relative_path] = _data_file(folder, info.relative_path, index.fqn, location)
        offset, length = counts((info.offset, info.length), f"{index.fqn}: byte range")
        extents.append(Extent(index.fqn, info.relative_path, offset, length))
        items[(index.fqn, counts(index.offset, f"{index.fqn}: chunk offset"))] = info
    missing = sorted(path for path, data_file in data_files.items() if not data_file.exists())
    if missing:  # an absent file holds no bytes: nothing it is said to hold can be bounded, or read
        raise CheckpointError(f"{data_files[missing[0]]}: missing ({len(missing)} data files missing); the save was "
                              "incomplete: copy the whole checkpoint folder again")
    file_sizes = {path: data_file.info()["size"] for path, data_file in data_files.items()}
    overclaim = overclaimed(extents, file_sizes.get)
    if overclaim:
        refuse(overclaim)
    folder_bytes = sum(file_sizes.values())
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape = counts(md.size, f"{key}: size")
        itemsize = _itemsize(md.properties.dtype)
        held, seen = 0, set()
        for chunk in md.chunks:
            offsets, sizes = counts(chunk.offsets, f"{key}: chunk offset"), counts(chunk.sizes, f"{key}: chunk size")
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + n > s for o, n, s in zip(offsets, sizes, shape)):
                refuse(f"{key}: chunk {sizes} at {offsets} lies outside its tensor {shape}")
            info = items.get((key, offsets))
            if info is None:  # bytes no file is said to hold: nothing bounds them
                refuse(f"{key}: chunk at {offsets} has no storage entry")
            if offsets in seen:  # one item's bytes counted twice
                refuse(f"{key}: two chunks at {offsets} claim one storage item")
            seen.add(offsets)
            if math.prod(sizes) * itemsize > info.length:
                refuse(f"{key}: chunk {sizes} at {offsets} needs {math.prod(sizes) * itemsize} bytes but its storage "
                       f"item holds {info.length}")
            held += math.prod(sizes)
        if math.prod(shape) > held:
            refuse(f"{key}: declares {math.prod(shape)} elements ({shape}) but its chunks hold {held}")
        if places(shape) > folder_bytes:
            refuse(f"{key}: shape {shape} claims {places(shape)} places but the data files hold {folder_bytes} bytes")


def _data_file(folder: Location, relative, fqn: str, shown: Location) -> Location:
    """`folder/relative`, refused unless `relative` is a plain relative path that stays inside `folder`
    (also once symlinks are resolved, for local folders)."""
    plain = isinstance(relative, str) and relative and "\\" not in relative and "\x00" not in relative
    if not plain or posixpath.isabs(relative) or posixpath.normpath(relative) != relative \
            or relative.split("/")[0] in ("..", ".") or "://" in relative or "::" in relative:
        raise CheckpointError(
            f"{shown}: {fqn} is stored in {str(relative)[:100]!r}, not a file of the checkpoint folder; the metadata was "
            "tampered with: ckptflow only reads data files inside the checkpoint folder"
        )
    location = folder.join(relative)
    if folder.is_local:
        real_folder, real = os.path.realpath(folder.url), os.path.realpath(location.url)
        if os.path.commonpath([real_folder, real]) != real_folder:
            raise CheckpointError(
                f"{shown}: {fqn} is stored in {relative!r}, which resolves to {real}, outside the checkpoint folder; "
                "ckptflow only reads data files inside the checkpoint folder: copy the real files in"
            )
    return location


def _itemsize(dtype) -> int:
    """Bytes per element of a dtype name; 1 for dtypes we never read (their chunks are never loaded)."""
    try:
        return element_size(str(dtype))
    except ValueError:
        return 1
