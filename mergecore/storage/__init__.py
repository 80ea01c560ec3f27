"""Where checkpoints live: any fsspec URL, read through one small `Location` type.

The package's face: its public names, each from the module that does one job — `locations.py` (a `Location`,
remote reads retried, verified cached copies, fingerprints), `publishable.py` (which huggingface/ files of a
checkpoint may be published, opened link-safely), `ranges.py` (remote rank files read by byte range, batched).
Beside them: `tensorio.py` (safetensors and JSON reading), `retries.py`, `ledger.py`.
"""

from .locations import (
    Location, RemoteReadError, default_cache_dir, file_kind, fingerprint_of, open_regular,
)
from .publishable import checked_publishable, link_root, publishable_hf_files
from .ranges import RangeFile, fetch_ranges, range_gap

__all__ = [
    "Location", "RemoteReadError", "default_cache_dir", "file_kind", "fingerprint_of", "open_regular",
    "checked_publishable", "link_root", "publishable_hf_files", "RangeFile", "fetch_ranges", "range_gap",
]
