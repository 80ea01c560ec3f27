"""Faults survived: a disk too small or filling up, a file-size limit, and kill -9 at random points.

Real processes and real limits: `ckptflow merge` / `promote` run as subprocesses, a tmpfs is
mounted for the disk-full cases (skipped where mounting is not allowed), RLIMIT_FSIZE is set in
the child, and kills are SIGKILL to the whole process group (the embedded Prefect server too).
"""

from __future__ import annotations

from helpers import REPO, Looking
import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mergecore import CheckpointError, merge_checkpoint
from mergecore.engine.writer import check_free_space

PYTHON = sys.executable
ROOT = REPO
MANIFEST = "ckptflow_manifest.json"


def ckptflow(*args: str | Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(popen.pop("env", {}))
    env = {name: value for name, value in env.items() if value is not None}  # None: unset
    return subprocess.Popen([PYTHON, "-m", "ckptflow.flows.cli", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def finished(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


def one_line_error(stderr: str) -> str:
    message = stderr.strip()
    assert message.startswith("error:") and "\n" not in message, stderr[-3000:]
    return message


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.ckptflow-partial*"))


# ------------------------------------------------------------------ disk space


def test_free_space_check_takes_the_free_bytes():
    check_free_space(1000, 1000, Path("out/model"))  # exactly fits
    with pytest.raises(CheckpointError, match=r"^out/model: needs 1.0 kB but its disk has 999 bytes free; .*another --target_dir"):
        check_free_space(1000, 999, Path("out/model"))


@contextmanager
def tmpfs(folder: Path, size: str):
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_disk_too_small_is_refused_before_writing(cli, demo, tmp_path):
    with tmpfs(tmp_path / "small", "1m") as disk:
        target = disk / "model"
        result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", target)
        assert result.exit_code == 2, result.output
        message = one_line_error(result.stderr)
        assert f"{target}: needs" in message and "MB free" in message and "another --target_dir" in message
        assert list(disk.iterdir()) == []


def test_a_disk_filling_up_during_the_merge_is_a_one_line_error(demo, tmp_path):
    """Another process fills the disk after the first group: the metadata writes hit ENOSPC."""
    with tmpfs(tmp_path / "filling", "8m") as disk:
        target = disk / "model"

        def fill_the_disk(group, receipt):
            if group == "embed":
                subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k"], capture_output=True)

        with pytest.raises(CheckpointError, match=rf"^{target}: No space left on device while writing .*free space"):
            merge_checkpoint(str(demo("fsdp2-w2").role_dir), target, on_group=fill_the_disk)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def limited_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_file_size_limit_leaves_the_previous_target_untouched(demo, tmp_path):
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "model"
    merge_checkpoint(str(role_dir), target, dtype="fp32")
    before = folder_bytes(target)

    code, _, stderr = finished(ckptflow("merge", "--local_dir", role_dir, "--target_dir", target, "--overwrite",
                                        preexec_fn=limited_file_size(64 << 10)))
    assert code == 2, stderr[-3000:]
    message = one_line_error(stderr)
    assert f"{target}: File too large while writing" in message and "free space" in message
    assert leftovers(target) == []
    assert folder_bytes(target) == before


# ------------------------------------------------------------------ kill -9


class TargetWatch(Looking):
    """A thread that looks at targets every millisecond: each must be absent or complete.

    Complete: every file of the uninterrupted run's manifest with its size, and a manifest.
    """

    def __init__(self, expected_sizes: dict[str, int]):
        super().__init__()
        self.expected_sizes = expected_sizes
        self.targets: list[Path] = []
        self.seen: dict[Path, float] = {}   # target -> when first seen (monotonic)
        self.violations: list[str] = []

    def look(self):
        for target in list(self.targets):
            self._look(target)

    def _look(self, target: Path):
        try:
            names = {p.name: p.stat().st_size for p in target.iterdir()}
        except FileNotFoundError:
            return
        self.seen.setdefault(target, time.monotonic())
        wrong = {n: s for n, s in self.expected_sizes.items() if names.get(n) != s}
        if wrong or MANIFEST not in names:
            self.violations.append(f"{target}: partial, {wrong or 'no manifest'}")


def assert_same_output(target: Path, baseline: Path):
    """Every file but the manifest byte for byte; the manifest's file list and sha256s."""
    mine, theirs = folder_bytes(target), folder_bytes(baseline)
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        if name != MANIFEST:
            assert mine[name] == theirs[name], name
    digests = lambda folder: {n: f["sha256"] for n, f in json.loads((folder / MANIFEST).read_text())["files"].items()}  # noqa: E731
    assert digests(target) == digests(baseline)


def run_and_kill(argv: list, delay: float, staging: Path | None = None, env: dict | None = None) -> str:
    """Start `ckptflow ARGV`, SIGKILL its process group `delay` s after start (or after `staging` appears)."""
    process = ckptflow(*argv, start_new_session=True, env=env or {})
    if staging is not None:
        deadline = time.monotonic() + 120
        while not staging.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
    time.sleep(delay)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    code, _, stderr = finished(process, 60)
    return "killed" if code == -signal.SIGKILL else f"finished ({code}): {stderr[-2000:]}"


def test_merge_killed_at_random_points_then_rerun_gives_the_same_bytes(demo, tmp_path):
    role_dir = demo("fsdp2-w2").role_dir
    merge = lambda target: ["merge", "--local_dir", role_dir, "--target_dir", target, "--workers", "1"]  # noqa: E731
    baseline = tmp_path / "baseline"
    started = time.monotonic()
    staging_seen = published = None
    process = ckptflow(*merge(baseline))
    while process.poll() is None:  # when the staging folder appears and the target is published
        if staging_seen is None and leftovers(baseline):
            staging_seen = time.monotonic() - started
        if published is None and baseline.exists():
            published = time.monotonic() - started
        time.sleep(0.001)
    assert process.returncode == 0, process.stderr.read()[-3000:]
    assert staging_seen is not None and published is not None
    manifest = json.loads((baseline / MANIFEST).read_text())
    sizes = {name: f["size"] for name, f in manifest["files"].items()}

    rng = random.Random(20261129)
    points = {"prepare": rng.uniform(0.3, 0.95) * staging_seen,           # importing, opening, planning
              "merge": rng.uniform(0.0, 0.005),  # right after the staging folder appeared: while groups are written
              "publish": rng.uniform(0.6, 0.95) * (published - staging_seen)}  # verifying, hashing, metadata
    interrupted = {}  # point -> the kill left a staging folder for the rerun to resume
    with TargetWatch(sizes) as watch:
        for point, delay in points.items():
            target = tmp_path / point
            watch.targets.append(target)
            outcome = run_and_kill(merge(target), delay, staging=None if point == "prepare" else leftovers_path(target))
            interrupted[point] = bool(leftovers(target))
            if not target.exists():  # killed before publishing: the rerun resumes or starts over
                code, _, stderr = finished(ckptflow(*merge(target)))
                assert code == 0, f"{point} ({outcome}): {stderr[-3000:]}"
            assert_same_output(target, baseline)
            assert leftovers(target) == [], point
    assert watch.violations == []
    assert any(interrupted.values()), f"no kill landed between staging and publish: {points}"


def leftovers_path(target: Path) -> Path:
    return target.parent / f".{target.name}.ckptflow-partial"


def test_promote_killed_mid_merge_then_rerun_gives_the_same_bytes(prefect_server, demo, tmp_path):
    """`ckptflow promote` on its embedded Prefect server, killed with the server after its staging appeared;
    the rerun resumes from the files and results on disk, here against the session's server (no second
    embedded server to start)."""
    from prefect.settings import PREFECT_API_URL

    ckpt = demo("fsdp2-w2")
    baseline = tmp_path / "baseline"
    merge_checkpoint(str(ckpt.role_dir), baseline)
    sizes = {name: f["size"] for name, f in json.loads((baseline / MANIFEST).read_text())["files"].items()}
    target = tmp_path / "promoted"
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": None, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}  # the 2 shared cores may be busy
    promote = ["promote", ckpt.run_root, "--target", target]
    with TargetWatch(sizes) as watch:
        watch.targets.append(target)
        outcome = run_and_kill(promote, random.Random(7).uniform(0.0, 0.2), staging=leftovers_path(target), env=env)
        assert outcome == "killed", outcome
        code, _, stderr = finished(ckptflow(*promote, env={"PREFECT_API_URL": PREFECT_API_URL.value()}))
        assert code == 0, f"{outcome}: {stderr[-3000:]}"
    assert watch.violations == []
    assert_same_output(target, baseline)
