"""A published model's files read where they lie, and the one check of them against their manifest.

A `ModelReader` answers what the checks ask of a model's files, whatever the place: which files are there (`names`),
a file's size, modification time, bytes and sha256, and a weight file's bytes on local disk for as long as its
tensors are read (`local_copy`). Two places: a local folder (`FolderReader`: the files themselves), and object
storage (`ObjectStorageReader`: small files read whole into memory; a weight file fetched by ranged GETs into a
sparse local file, `storage.RangeFile`, released when its block ends, so local disk holds one weight file at a time,
never the model).

`check_manifest` is the one manifest check, for `verify` and for the cheap check of a rerun alike: every listed file
is there and unchanged (its sha256, or cheaply its size and, where the place keeps one, its modification time), and
where the place holds only its model (a folder) nothing lies beside the listed files. On object storage the model is,
by the visibility rule of docs/remote_targets.md, exactly the files its manifest lists: other objects under the
prefix are not the model and are not read.

>>> check_manifest(model_reader("out/model"), load_manifest("out/model"), full=False)  # doctest: +SKIP
{'check': 'manifest (size, mtime)', 'files': 7, 'ok': True}
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from ..model.manifest import MANIFEST_FILE, file_changed, file_missing, sha256_file
from ..errors import VerificationError
from ..storage import Location, RangeFile
from ..storage.tensorio import WEIGHT_SUFFIXES


class ModelReader(ABC):
    """What the checks read of a published model's files; `name` is a file's name in the model, as its manifest
    lists it. Reads of a file that is not there raise FileNotFoundError (`check_manifest` names it missing)."""

    place: Path | Location  # the model's folder or URL, as messages name it
    keeps_mtimes = False  # whether the place records when each file was written (the cheap check compares it)

    @abstractmethod
    def file(self, name: str) -> Path | Location:
        """Where file `name` lies, as messages name it."""

    @abstractmethod
    def names(self) -> set[str] | None:
        """Every file present (links and special files too, at any depth), where the place holds only its model;
        None where the model is just the files its manifest lists (object storage)."""

    @abstractmethod
    def size(self, name: str) -> int:
        """File `name`'s size in bytes."""

    def modified_ns(self, name: str) -> int | None:
        """When `name` was last written (ns), where the place keeps it (None: not compared)."""
        return None

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """A small file's bytes (config, index, tokenizer files, card): weight files go through `local_copy`."""

    def sha256(self, name: str) -> str:
        """The sha256 of a small file (see `read_bytes`)."""
        return hashlib.sha256(self.read_bytes(name)).hexdigest()

    @abstractmethod
    def local_copy(self, name: str) -> AbstractContextManager[str | Path]:
        """A local path holding file `name`'s bytes for the time of the block (a weight file's: hashed, then its
        tensors read from those very bytes)."""

    def named_file(self, name: str) -> NamedFile:
        """File `name` as `tensorio.read_json` and `read_weight_map` take it: its text, named by its place."""
        return NamedFile(self, name)


class NamedFile:
    """One of a model's files as the JSON readers take it: `read_text()`, and `str()` naming where it lies."""

    def __init__(self, reader: ModelReader, name: str):
        self.reader, self.name = reader, name

    def read_text(self) -> str:
        return self.reader.read_bytes(self.name).decode("utf-8")

    def __str__(self) -> str:
        return str(self.reader.file(self.name))


class FolderReader(ModelReader):
    """A model in a local folder: its files read in place."""

    keeps_mtimes = True

    def __init__(self, folder: str | os.PathLike):
        self.place = Path(folder)

    def file(self, name: str) -> Path:
        return self.place / name

    def names(self) -> set[str]:
        return {p.relative_to(self.place).as_posix() for p in self.place.rglob("*") if p.is_symlink() or not p.is_dir()}

    def size(self, name: str) -> int:
        return self.file(name).stat().st_size

    def modified_ns(self, name: str) -> int:
        return self.file(name).stat().st_mtime_ns

    def read_bytes(self, name: str) -> bytes:
        return self.file(name).read_bytes()

    def sha256(self, name: str) -> str:
        return sha256_file(self.file(name))

    @contextmanager
    def local_copy(self, name: str) -> Iterator[Path]:
        yield self.file(name)


class ObjectStorageReader(ModelReader):
    """A model on object storage (any fsspec URL), read by object: never a local copy of the whole model."""

    def __init__(self, location: Location):
        self.place = location
        self._small: dict[str, bytes] = {}  # each small file is GET once per check, however many checks read it

    def file(self, name: str) -> Location:
        return self.place.join(name)

    def names(self) -> None:
        return None  # the visibility rule: only the files the manifest lists are the model

    def size(self, name: str) -> int:
        location = self.file(name)
        return int(location.retried("stat", location.fresh_info)["size"])

    def read_bytes(self, name: str) -> bytes:
        if name not in self._small:
            self._small[name] = self.file(name).read_bytes()
        return self._small[name]

    @contextmanager
    def local_copy(self, name: str) -> Iterator[str]:
        copy = RangeFile.of(self.file(name))
        copy.fetch([(0, copy.size)])
        yield copy.path  # its space is freed once this block and the readers of its bytes are done


def model_reader(place: str | os.PathLike | Location) -> ModelReader:
    """The reader of the model at `place`: a local folder, or an fsspec URL (s3://bucket/model)."""
    location = Location.of(place)
    return FolderReader(location.fs_path[1]) if location.is_local else ObjectStorageReader(location)


def weight_files(manifest: dict) -> list[str]:
    """The weight files a manifest lists, in name order: the model's top-level .safetensors (or .bin) files (a LoRA
    adapter's, one folder down, is a small file)."""
    return sorted(name for name in manifest["files"] if "/" not in name and name.endswith(WEIGHT_SUFFIXES))


def check_manifest(reader: ModelReader, manifest: dict, full: bool = True, deferred: Collection[str] = ()) -> dict:
    """The model's files are its manifest's: nothing beside them (where `reader.names()` tells), and each listed file
    there and unchanged: re-hashed (a weight file through `proven_copy`), or with `full=False` only its size and,
    where the place keeps it, its modification time compared (enough to notice any ordinary write). `deferred`:
    weight files the caller proves itself with `proven_copy` while it reads their tensors. Returns the result row."""
    files: dict[str, dict] = manifest["files"]
    present = reader.names()
    if present is not None:
        unlisted = sorted(present - {*files, MANIFEST_FILE})
        if unlisted:
            raise VerificationError(f"{reader.place}: holds {len(unlisted)} file(s) its {MANIFEST_FILE} does not list "
                                    f"({', '.join(unlisted[:3])}); they are not part of the merged model: remove them "
                                    "or merge again")
    weights = set(weight_files(manifest))
    for name, entry in files.items():
        if name in deferred:
            continue
        if full and name in weights:
            with proven_copy(reader, name, entry):
                pass  # hashed from its local copy (from object storage: fetched by ranges, released here)
            continue
        try:
            if full:
                changed = reader.sha256(name) != entry["sha256"]
            else:
                modified = reader.modified_ns(name)
                changed = reader.size(name) != entry["size"] or \
                    (modified is not None and modified != entry.get("mtime_ns", modified))
        except FileNotFoundError:
            raise file_missing(reader.file(name)) from None
        if changed:
            raise file_changed(reader.file(name))
    cheaply = "manifest (size, mtime)" if reader.keeps_mtimes else "manifest (size)"
    return {"check": "manifest" if full else cheaply, "files": len(files), "ok": True}


def check_published(place: str | os.PathLike | Location, manifest: dict) -> dict:
    """The cheap check of a published model, wherever it is: every file its manifest lists is there with its size
    (and, in a folder, its modification time), nothing beside them where the place can tell; no byte is read
    (`ckptflow verify` re-hashes). Returns the result row."""
    return check_manifest(model_reader(place), manifest, full=False)


@contextmanager
def proven_copy(reader: ModelReader, name: str, entry: dict) -> Iterator[str | Path]:
    """File `name`'s bytes on local disk (`reader.local_copy`), proven to be its manifest `entry`'s: its size first
    (a wrong object is never fetched), then its sha256, so what the block reads is what the manifest lists."""
    where = reader.file(name)
    with ExitStack() as stack:
        try:
            if reader.size(name) != entry["size"]:
                raise file_changed(where)
            local = stack.enter_context(reader.local_copy(name))
        except FileNotFoundError:
            raise file_missing(where) from None
        if sha256_file(local) != entry["sha256"]:
            raise file_changed(where)
        yield local

