"""What a process holds in row blocks is bounded whatever the relative speed of reading and writing.

The pipeline merges two groups at once, each with two workers: four threads that each read, cast and write row
blocks. With the disk slower than the reader (each write waits), every thread used to hold a block it could not
hand on, so in-flight memory grew with the number of threads (408 MB seen once on a loaded machine, 170 MB quiet).
Now at most `CKPTFLOW_BLOCKS_IN_FLIGHT` (2) blocks are held by the process at a time.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

from mergecore.engine.merge import prepare
from mergecore.engine.writer import TensorWriter, prepare_files

BUDGET = 1 << 20  # bytes per block: the vocab-8k embedding and head (2 MiB of fp32 each) span several blocks


def peak_of_writes(prepared, staging, names: list[str]) -> int:
    """Peak traced bytes while one thread per name writes that planned tensor (the same tensor twice: harmless)."""
    entries = {entry.name: entry for group in prepared.plan.groups for entry in prepared.plan.in_group(group)}
    start = threading.Barrier(len(names))

    def write(name):
        start.wait()
        writer.write_tensor(prepared.source, entries[name], BUDGET, "warn", {})

    tracemalloc.start()
    try:
        with TensorWriter(prepared.plan, staging) as writer:
            threads = [threading.Thread(target=write, args=(name,)) for name in names]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_blocks_in_flight_stay_bounded_when_the_disk_is_slower_than_the_reader(demo, tmp_path, monkeypatch):
    prepared = prepare(str(demo("fsdp2-w2-vocab8k").role_dir), dtype="fp32")
    prepare_files(prepared.plan, tmp_path)
    one = peak_of_writes(prepared, tmp_path, ["model.embed_tokens.weight"])  # one block at a time

    write = os.pwrite

    def slow_disk(fd, data, offset):  # each write waits: readers finish their next block meanwhile
        time.sleep(0.05)
        return write(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_disk)
    four = peak_of_writes(prepared, tmp_path, ["model.embed_tokens.weight", "lm_head.weight"] * 2)
    assert four < 2.5 * one, (four, one)  # two blocks held at most, not four
