"""The proof of one weight file just streamed to object storage, read back before the merge records it.

The remote writer (`engine.remote_writer.write_remote_file`) sits below the proofs, so its caller hands this
check down to it (`prove=check_stored_file`). The `verify` of a published model, wherever it lies, is
`published.verify_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import VerificationError
from ..formats import CheckpointSource
from ..model.manifest import sha256_file
from ..storage import Location, RangeFile
from ..storage.tensorio import SafetensorsFile
from .verify import round_trip_of

if TYPE_CHECKING:
    from ..engine.plan import MergePlan


def check_stored_file(source: CheckpointSource, plan: MergePlan, file: str, location: Location, stored: dict,
                      sha256: str) -> tuple[int, dict]:
    """Read the stored object back (into a sparse local file: one output file of local space at most) and prove
    it: the bytes hash to what was sent, the header names exactly the planned tensors, and every tensor (and each
    dropped alias it stands for) equals every rank's shard, or, quantized, is the quantization of its rows within
    the scheme's bound. Returns (pieces compared, the quantized errors: {} without any)."""
    copy = RangeFile(location, stored)
    copy.fetch([(0, copy.size)])
    if sha256_file(copy.path) != sha256:
        raise VerificationError(f"{location}: the stored object differs from the bytes sent (sha256); "
                                "the storage changed it or another writer replaced it: merge again")
    weights = SafetensorsFile(copy.path)
    names = {t.name for t in plan.in_file(file)}
    if set(weights.keys()) != names:
        raise VerificationError(f"{location}: holds {sorted(set(weights.keys()) ^ names)[:3]} beside or instead "
                                "of the planned tensors; merge again")
    return round_trip_of(source, weights.get_tensor, names, plan.aliases, plan, location.parent)
