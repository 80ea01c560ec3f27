"""The opened checkpoint of a promotion, kept per process under a key made of what flows on the DAG's edges.

`discover_shards` opens the checkpoint (as merged: `mergecore.engine.merge.as_merged`) and returns its
description with the input files' fingerprints and their digest, `identity`. Every later task receives the
request and that description and asks `opened(request, discovered)` for the source:
- in the process that discovered it (the flow's threads), it is the very object discovery opened: one open
  per process per promotion (opening mmaps every rank file and reads their metadata);
- in a fresh process (a Dask worker, one task rerun alone) it is opened anew from the request, and its files
  must still be those discovery saw (same identity), else the task refuses: a plan made from other files
  must not be applied to these.
So the memo is an optimisation only: what a task computes depends on its inputs, never on what ran before it
in the same process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from mergecore import CheckpointError, MergeRequest
from mergecore.engine.merge import as_merged, described_inputs
from mergecore.formats import CheckpointSource

_KEPT = 4  # promotions whose opened checkpoints a process keeps (a service runs several, one after another)
_opened: OrderedDict[tuple, CheckpointSource] = OrderedDict()
_lock = threading.Lock()


def discover(request: MergeRequest) -> dict:
    """Open the checkpoint of `request` afresh and describe it (`described_inputs`); the opened source is kept for
    the tasks of this process that get this description."""
    source = as_merged(request.what)
    described = described_inputs(source)
    _keep((request.what, described["identity"]), source)
    return described


def opened(request: MergeRequest, discovered: dict) -> CheckpointSource:
    """The checkpoint of `request` as `discovered` described it: the one opened in this process, or opened now and
    checked to be unchanged since."""
    key = (request.what, discovered["identity"])
    with _lock:
        if key in _opened:
            _opened.move_to_end(key)
            return _opened[key]
    source = as_merged(request.what)
    if described_inputs(source)["identity"] != discovered["identity"]:
        raise CheckpointError(f"{source.location}: its files changed since the promotion discovered them (sizes or "
                              "modification times differ); run the promotion again")
    _keep(key, source)
    return source


def _keep(key: tuple, source: CheckpointSource) -> None:
    with _lock:
        _opened[key] = source
        _opened.move_to_end(key)
        while len(_opened) > _KEPT:
            _opened.popitem(last=False)


def forget_opened() -> None:
    """Drop every kept checkpoint (benchmarks: measure a promotion as a fresh process would run it)."""
    with _lock:
        _opened.clear()
