"""Where a merged model is published: one storage interface for a local folder and for object storage.

Every writer — the CLI's merge, the pipeline's tasks and Dask workers, the LoRA adapter writer — goes through
`open_target(url)`, and this module is the only place that asks whether a place is local or remote. A target
is storage only: the checks (not overlapping the checkpoint, replacing only an empty folder or a model ckptflow
published), one lock from staging to publish, staging, reading back the published manifest, and publishing.
What is written there and how it is proven is `mergecore.assembly`'s.

>>> target = open_target("out/model")                          # doctest: +SKIP
>>> with target.lock():                                        # doctest: +SKIP
...     target.check(overwrite=False, sources=["ckpts/run1"])
...     staging = target.open_staging()
"""

from __future__ import annotations

from os import PathLike

from ..storage import Location
from .base import Target
from .local import LocalTarget
from .remote import RemoteTarget

__all__ = ["LocalTarget", "RemoteTarget", "Target", "open_target"]


def open_target(url: str | PathLike | Location | Target) -> Target:
    """The target behind `url`: a local folder (links and `..` resolved) or an fsspec URL such as s3://bucket/model."""
    if isinstance(url, Target):
        return url
    location = Location.of(url)
    return LocalTarget(location.url) if location.is_local else RemoteTarget(location)
