"""What a published model says about where it came from, and what only this machine keeps.

A model's manifest and card travel (to the Hub, to object storage, to whoever downloads them), so they name
their sources publicly: a local checkpoint by its run-relative name (`run1/global_step_100/actor`), a URL without
credentials or query. The full local paths — which `verify` reopens by default — stay in a ledger on this machine
(`$CKPTFLOW_CACHE/sources/<weights_id>.json`), keyed by the model's `weights_id`, which already names exactly one
merge of one set of input files.

>>> public_name("/home/alice/ckpts/run1/global_step_100/actor")
'run1/global_step_100/actor'
>>> public_name("s3://key:secret@ckpts/run1/actor?versionId=3")
's3://ckpts/run1/actor'
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .locations import default_cache_dir

_STEP_FOLDER = re.compile(r"global_step_\d+")
# Where a manifest's `source` holds a path or URL: (keys from the source entry down to the value).
PATH_FIELDS = (("location",), ("options", "hf_dir"), ("options", "custom_mapping"), ("options", "lora", "base_model"),
               ("lora", "base_model"))


def public_name(value: str) -> str:
    """`value` as a published model names it: a URL without user, password, query or fragment; a local path
    from the run folder above `global_step_N` down (just its last name when there is no such folder)."""
    if "://" in value:
        parts = urlsplit(value)
        return urlunsplit((parts.scheme, parts.hostname or "", parts.path, "", ""))
    names = [name for name in re.split(r"[/\\]+", value) if name not in ("", ".")]
    steps = [i for i, name in enumerate(names) if _STEP_FOLDER.fullmatch(name)]
    return "/".join(names[max(steps[-1] - 1, 0):]) if steps else (names[-1] if names else value)


def split_private(source: dict) -> tuple[dict, dict]:
    """(`source` with each path field (`PATH_FIELDS`) in its public form, {field path: [public, original]} of the
    ones that changed) — a Hub repo id or a URL without credentials stays as it is.

    >>> split_private({"location": "/home/alice/run1/global_step_1/actor", "options": {"hf_dir": None}})
    ({'location': 'run1/global_step_1/actor', 'options': {'hf_dir': None}}, {'location': ['run1/global_step_1/actor', '/home/alice/run1/global_step_1/actor']})
    """
    public, private = json.loads(json.dumps(source)), {}
    for keys in PATH_FIELDS:
        holder = _holder(public, keys)
        value = holder.get(keys[-1]) if holder is not None else None
        if isinstance(value, str) and _is_private(value) and public_name(value) != value:
            holder[keys[-1]] = public_name(value)
            private["/".join(keys)] = [public_name(value), value]
    return public, private


def with_private(source: dict, private: dict) -> dict:
    """`source` with the values `split_private` took out put back, where it still holds what was put in their
    place (a manifest edited since names something else: that stays as it is)."""
    full = json.loads(json.dumps(source))
    for joined, (shown, value) in private.items():
        keys = joined.split("/")
        holder = _holder(full, keys)
        if holder is not None and holder.get(keys[-1]) == shown:
            holder[keys[-1]] = value
    return full


def _holder(source: dict, keys: tuple[str, ...] | list[str]) -> dict | None:
    """The dict that holds the field `keys` names (None when a dict on the way is missing)."""
    holder = source
    for key in keys[:-1]:
        holder = holder.get(key) if isinstance(holder, dict) else None
    return holder if isinstance(holder, dict) else None


def remember(weights_id: str, private: dict) -> None:
    """Keep `private` (from `split_private`) for the model of `weights_id`, on this machine only."""
    if not private or not _is_key(weights_id):
        return
    folder = _ledger()
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{weights_id}.")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(private, stream)
        os.replace(partial, folder / f"{weights_id}.json")
    finally:
        Path(partial).unlink(missing_ok=True)


def recalled(weights_id) -> dict:
    """What `remember` kept for `weights_id` ({} when this machine did not merge it, or its ledger was cleared)."""
    if not _is_key(weights_id):
        return {}
    try:
        found = json.loads((_ledger() / f"{weights_id}.json").read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(found, dict) and all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)
                                         for v in found.values())
    return found if ok else {}


def _is_private(value: str) -> bool:
    """A URL, or a local path that exists or is absolute (a Hub repo id such as `org/base` is neither)."""
    return "://" in value or os.path.isabs(os.path.expanduser(value)) or os.path.exists(value)


def _is_key(weights_id) -> bool:
    return isinstance(weights_id, str) and re.fullmatch(r"[0-9a-f]{16,128}", weights_id) is not None


def _ledger() -> Path:
    return default_cache_dir() / "sources"
