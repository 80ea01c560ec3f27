"""Remote reads under faults: a `flaky://` filesystem (test-only fsspec wrapper around the local disk)
whose opens and reads fail the first N times, as a throttled or dropped connection would."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import fsspec
import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from mergecore import CheckpointError, compare_with_reference, merge_checkpoint

RANK0 = "model_world_size_2_rank_0.pt"
RANK1 = "model_world_size_2_rank_1.pt"


@dataclass
class Fault:
    path_regex: str
    remaining: int
    midway: bool  # fail after half the file was read (a dropped download), else at open


class FlakyFileSystem(AbstractFileSystem):
    """`flaky:///abs/path`: the local file system, except that planned faults raise ConnectionError."""

    protocol = "flaky"
    faults: list[Fault] = []
    opened: list[str] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.disk = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        return (path[len("flaky://"):] if path.startswith("flaky://") else path).rstrip("/") or "/"

    def ls(self, path, detail=True, **kwargs):
        return self.disk.ls(path, detail=detail)

    def info(self, path, **kwargs):
        return self.disk.info(path)

    def _open(self, path, mode="rb", **kwargs):
        self.opened.append(path)
        fault = self._due(path)
        if fault and not fault.midway:
            raise ConnectionError(f"connection reset by peer while opening {path}")
        file = self.disk._open(path, mode)
        return DroppedHalfway(file, self.disk.size(path)) if fault else file

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self.open(path, "rb") as f:
            data = f.read()  # a dropped connection fails here, wherever the range lies
        return data[start:end]

    def _due(self, path) -> Fault | None:
        for fault in self.faults:
            if fault.remaining > 0 and re.search(fault.path_regex, path):
                fault.remaining -= 1
                return fault
        return None


class DroppedHalfway(io.RawIOBase):
    """Reads that stop with ConnectionResetError once half of the file went through."""

    def __init__(self, file, size: int):
        self.file, self.left = file, size // 2

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.left <= 0:
            raise ConnectionResetError("connection reset by peer mid-download")
        data = self.file.read(min(len(buffer), self.left))
        buffer[:len(data)] = data
        self.left -= len(data)
        return len(data)

    def close(self):
        self.file.close()
        super().close()


@pytest.fixture
def flaky(monkeypatch, tmp_path):
    """`flaky.fail(path_regex, times, midway=False)`; reads retried quickly; a fresh download cache."""
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(FlakyFileSystem, "faults", [])
    monkeypatch.setattr(FlakyFileSystem, "opened", [])
    monkeypatch.setenv("CKPTFLOW_READ_BACKOFF", "0.01")
    monkeypatch.setenv("CKPTFLOW_CACHE", str(tmp_path / "cache"))

    class Planner:
        opened = FlakyFileSystem.opened

        @staticmethod
        def fail(path_regex: str, times: int, midway: bool = False) -> None:
            FlakyFileSystem.faults.append(Fault(path_regex, times, midway))

        @staticmethod
        def left() -> list[int]:
            return [f.remaining for f in FlakyFileSystem.faults]

    return Planner


def test_transient_read_errors_are_retried_and_the_merge_is_unchanged(flaky, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "plain", dtype="keep")

    flaky.fail(RANK0 + "$", 2)  # the first two opens of rank 0 fail
    flaky.fail(RANK1 + "$", 1, midway=True)  # the first download of rank 1 dies halfway
    flaky.fail("config.json$", 1)
    merge_checkpoint(f"flaky://{ckpt.role_dir}", tmp_path / "flaky", dtype="keep")

    assert flaky.left() == [0, 0, 0]  # every fault was hit
    assert sum(p.endswith(RANK0) for p in flaky.opened) >= 3  # read by range: one open per batch of ranges
    written = sorted(p.name for p in (tmp_path / "plain").iterdir() if p.suffix in (".safetensors", ".json"))
    assert any(name.endswith(".safetensors") for name in written)
    for name in set(written) - {"ckptflow_manifest.json"}:  # the manifest names the source URL
        assert (tmp_path / "flaky" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert compare_with_reference(tmp_path / "flaky", ckpt.reference_dir)["max_abs_diff"] == 0.0
    assert not [p for p in (tmp_path / "cache").iterdir() if ".partial-" in p.name]  # the dropped half is gone


def test_persistent_read_errors_fail_in_one_line_after_the_budget(flaky, demo, cli, tmp_path, monkeypatch):
    ckpt = demo("fsdp2-w2")
    monkeypatch.setenv("CKPTFLOW_READ_RETRIES", "2")
    flaky.fail(RANK1 + "$", 1000)

    result = cli("merge", "--local_dir", f"flaky://{ckpt.role_dir}", "--target_dir", tmp_path / "out")
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert f"flaky://{ckpt.role_dir}/{RANK1}" in message and "3 times" in message and "ConnectionError" in message
    assert sum(p.endswith(RANK1) for p in flaky.opened) == 3  # 1 try + CKPTFLOW_READ_RETRIES
    assert not (tmp_path / "out").exists()


def test_missing_remote_file_is_not_retried(flaky, demo, tmp_path):
    from mergecore.storage import Location

    with pytest.raises(FileNotFoundError):
        Location.of(f"flaky://{demo('fsdp2-w2').role_dir}/no-such-file.pt").local_file()
    assert len(flaky.opened) == 0  # the stat said "not there": nothing to retry


def test_retry_policy_docstrings():
    import doctest

    import mergecore.hub
    import mergecore.storage.retries

    for module in (mergecore.storage.retries, mergecore.hub):
        result = doctest.testmod(module)
        assert result.attempted and result.failed == 0, module.__name__
