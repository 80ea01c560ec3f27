"""Plain helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import io
import socket
import struct
import threading
import time
import zipfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root, whatever folder a test sits in


_CLI_SAYING_IMPORTS = (
    "import sys\nfrom ckptflow.flows.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as done:\n"
    "    code = done.code\nelse:\n    code = 0\n"
    "print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\nsys.exit(code)")


def cli_in_fresh_process(*args, config_cache: Path):
    """`ckptflow ARGS` in a new Python process with `config_cache` as CKPTFLOW_CONFIG_CACHE: (the finished process,
    its last line: which of torch and transformers it imported, e.g. "imported: []")."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CKPTFLOW_CONFIG_CACHE": str(config_cache)}
    run = subprocess.run([sys.executable, "-c", _CLI_SAYING_IMPORTS, *map(str, args)], capture_output=True, text=True,
                         timeout=300, env=env)
    return run, run.stdout.strip().splitlines()[-1]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def upload(fs, ckpt, prefix: str) -> str:
    for bucket in (prefix.split("/")[0], "io-models"):
        if not fs.exists(bucket):
            fs.mkdir(bucket)
    fs.put(str(ckpt.role_dir), f"{prefix}/global_step_1/actor", recursive=True)  # the step is in the card
    return f"s3://{prefix}/global_step_1/actor"


def rank_file_bytes(ckpt, names, ranks=None) -> int:
    """Bytes the FSDP rank files of `ckpt` (a DemoCheckpoint) hold of the tensors `names`: each rank's local shard,
    over `ranks` (default: all of them), read with torch itself."""
    import torch
    import torch.distributed.tensor  # noqa: F401  (DTensor's unpickling needs it)

    files = sorted(ckpt.role_dir.glob("model_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    total = 0
    for rank, path in enumerate(files):
        if ranks is None or rank in ranks:
            state = torch.load(path, map_location="cpu", weights_only=True)
            total += sum(state[n].to_local().numel() * state[n].element_size() for n in names)
    return total


def objects(fs, prefix: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {path[len(prefix) + 1:]: fs.cat_file(path) for path in fs.find(prefix)}


GROUPS = ["embed", "layers.0", "layers.1", "head"]


def merge_group_states() -> list[dict[str, str]]:
    """Per merge-checkpoint flow run, oldest first: {group: final state name} of its merge_group task runs.

    Task run states reach the server as events, processed asynchronously: read until two reads agree
    and every state is final.
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    previous = None
    for _ in range(100):
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="merge_group[")))
        snapshot = sorted((str(r.id), r.state.name if r.state else None, r.state.is_final() if r.state else False)
                          for r in runs)
        if snapshot == previous and all(final for _, _, final in snapshot):
            break
        previous = snapshot
        time.sleep(0.2)
    by_flow: dict = defaultdict(dict)
    started: dict = {}
    for run in runs:
        by_flow[run.flow_run_id][run.name.removeprefix("merge_group[").rstrip("]")] = run.state.name
        started[run.flow_run_id] = min(started.get(run.flow_run_id, run.expected_start_time), run.expected_start_time)
    return [by_flow[f] for f in sorted(by_flow, key=started.get)]


def assert_refused(result, target: Path, *fragments: str) -> None:
    """A refusal as the house wants it: exit 2, one `error:` line holding `fragments`, nothing at or beside `target`.
    `result`: a CliRunner result or a finished subprocess."""
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code == 2, result.stderr
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*"))


def damage_tensor_member(path: Path, offset: int = 0, length: int | None = None) -> str:
    """Overwrite 4 bytes in the middle of the largest tensor member (`.../data/N`) of the torch.save archive at
    `offset` of `path`, in place (the zip directory keeps the CRC-32 torch recorded); returns the member's name.
    The reproduced defect: such a file merged with rc 0 and "round-trip ok"."""
    data = path.read_bytes()
    item = data[offset:len(data) if length is None else offset + length]
    infos = [i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if "/data/" in i.filename]
    info = max(infos, key=lambda i: i.file_size)
    name_length, extra_length = struct.unpack_from("<HH", item, info.header_offset + 26)
    where = offset + info.header_offset + 30 + name_length + extra_length + info.file_size // 2
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(bytes(b ^ 0x5A for b in data[where:where + 4]))
    return info.filename


def damaged_fsdp(ckpt) -> tuple[Path, str]:
    path = ckpt.role_dir / "model_world_size_2_rank_0.pt"
    return path, damage_tensor_member(path)


@contextmanager
def torch_threads(count: int):
    """torch at `count` threads inside the block: MoE and attention kernels differ in the last bit across thread
    counts, so logits are compared at the thread count the reference was computed with."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Looking:
    """A thread calling `look()` every `every_s` seconds while a `with` block runs: a reader polling a target
    while a merge writes it. Subclasses say what one look checks (and record what they find)."""

    every_s = 0.001

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def look(self) -> None:
        raise NotImplementedError

    def _run(self):
        while not self._stop.is_set():
            self.look()
            time.sleep(self.every_s)



def require_engine(engine: str) -> str:
    """The interpreter of `engine`'s managed environment (`ckptflow engine install`, which ./dev test runs once);
    skipped where it is not installed, except in CI, where that is a failure."""
    import os

    import pytest

    from mergecore.serving.environment import installed

    record = installed(engine)
    if record is None:
        message = f"{engine} is not installed for ckptflow here: run `ckptflow engine install {engine}` (./dev test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return record["python"]


def engine_processes() -> list[str]:
    """Command lines of the engine probes running on this machine (none may outlive a check)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = status.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm_probe.py" in line:
            found.append(line)
    return found
