"""Assembling a verified model at a target: stage, merge each unit, prove, finish, publish.

The targets (`mergecore.targets`) are storage only: lock, stage, a reader, publish. The engine writes units and
the proofs check them. An assembly puts the three together for one target, so a merge's order of steps lives in
one place, above all three layers: `assembly_for(url)` gives it, and the API's merge, the pipeline's tasks and the
CLI all go through it.

>>> assembly = assembly_for("out/model")                          # doctest: +SKIP
>>> with assembly.lock():                                         # doctest: +SKIP
...     staged = assembly.stage(prepared, overwrite=False)
...     receipts = [assembly.write_unit(prepared, unit, staged) for unit in assembly.units(prepared.plan)]
...     manifest = assembly.finalize(prepared, staged, receipts, overwrite=False)
"""

from __future__ import annotations

from os import PathLike

from ..storage import Location
from ..targets import LocalTarget, Target, open_target
from .base import Assembly
from .folder import FolderAssembly
from .object_storage import ObjectStorageAssembly

__all__ = ["Assembly", "FolderAssembly", "ObjectStorageAssembly", "assembly_for"]


def assembly_for(target: str | PathLike | Location | Target) -> Assembly:
    """How a merge is assembled at `target` (a path, an fsspec URL or an opened target): in a staged folder, layer
    group by layer group, or on object storage, file by file."""
    place = open_target(target)
    return FolderAssembly(place) if isinstance(place, LocalTarget) else ObjectStorageAssembly(place)
