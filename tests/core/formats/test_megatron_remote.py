"""Megatron checkpoints on object storage (moto S3) are read by byte range, never the optimizer's bytes.

Bytes are counted at s3fs's boundary (`s3_reads` of test_remote_io, plus the ranges asked for). Where the
optimizer state lies is found independently of ckptflow: legacy archives with the standard `zipfile`
module (members whose bytes are the optimizer's fill value), dist_ckpt items with torch's own
`FileSystemReader.read_metadata()`.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch

from ckptflow.testing.megatron_dist_fixtures import OPTIMIZER_KEY, write_dist_checkpoint
from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint
from helpers import upload

s3fs = pytest.importorskip("s3fs")

OPTIMIZER_FILL = 7.0  # every optimizer tensor of the legacy fixture holds only this value
PUBLISHED_ELSEWHERE = {"ckptflow_manifest.json", "README.md"}  # they name the source URL


@pytest.fixture(scope="module")
def legacy_with_optimizer(tmp_path_factory):
    """A TP=2 legacy checkpoint whose `model.pt` files also hold optimizer state (Megatron-LM's layout:
    `{"model": ..., "optimizer": ...}` in one archive), each optimizer tensor filled with OPTIMIZER_FILL."""
    ckpt = write_megatron_checkpoint(tmp_path_factory.mktemp("legacy-optim"), "llama", tp=2, style="megatron-lm")
    for path in (ckpt.role_dir / "model").glob("mp_rank_*/model.pt"):
        saved = torch.load(path, weights_only=False)
        params = [t for t in saved["model"].values() if isinstance(t, torch.Tensor)]
        saved["optimizer"] = {
            "state": {i: {"exp_avg": torch.full_like(t, OPTIMIZER_FILL), "exp_avg_sq": torch.full_like(t, OPTIMIZER_FILL)}
                      for i, t in enumerate(params)},
            "param_groups": [{"lr": 1e-5, "params": list(range(len(params)))}],
        }
        torch.save(saved, path)
    return ckpt


@pytest.fixture(scope="module")
def dist_with_optimizer(tmp_path_factory):
    """A dist_ckpt checkpoint (verl 0.9.1 layout) whose .distcp file holds an optimizer box beside the model's,
    and an `optimizer/dist_ckpt` folder."""
    return write_dist_checkpoint(tmp_path_factory.mktemp("dist-optim"), "llama")


@pytest.fixture
def s3_ranges(s3_reads):
    """[(object key, start, end)] of every GET s3fs made (a whole GET: start 0, end None)."""
    asked = []
    ranged = s3fs.S3FileSystem._cat_file  # already counting for s3_reads

    async def cat_file(self, path, version_id=None, start=None, end=None):
        asked.append((path.split("://")[-1], start, end))
        return await ranged(self, path, version_id=version_id, start=start, end=end)

    s3fs.S3FileSystem._cat_file = cat_file
    s3fs.S3FileSystem.clear_instance_cache()
    yield asked
    s3fs.S3FileSystem._cat_file = ranged  # s3_reads' monkeypatch then restores the original
    s3fs.S3FileSystem.clear_instance_cache()


def optimizer_spans(archive: Path) -> list[tuple[int, int]]:
    """[start, end) of every `data/` member of a torch.save archive whose bytes are all OPTIMIZER_FILL (float32)."""
    fill = struct.pack("<f", OPTIMIZER_FILL)
    spans = []
    with zipfile.ZipFile(archive) as zf, open(archive, "rb") as raw:
        for info in zf.infolist():
            if "/data/" not in info.filename:
                continue
            raw.seek(info.header_offset)
            header = raw.read(30)
            start = info.header_offset + 30 + struct.unpack_from("<H", header, 26)[0] + struct.unpack_from("<H", header, 28)[0]
            if zf.read(info) == fill * (info.file_size // 4):
                spans.append((start, start + info.file_size))
    return spans


def overlapping(asked, key: str, spans) -> list:
    return [(s, e) for k, s, e in asked if k == key for lo, hi in spans if s < hi and (e is None or e > lo)]


def assert_same_folders(local: Path, remote: Path) -> None:
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert files == {p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file()}
    assert any(name.endswith(".safetensors") for name in files)
    for name in files - PUBLISHED_ELSEWHERE:
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name


def test_legacy_tp2_from_s3_reads_model_ranges_only(s3_env, s3_reads, s3_ranges, legacy_with_optimizer, tmp_path):
    from mergecore import merge_checkpoint

    ckpt = legacy_with_optimizer
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "local", dtype="bf16")
    source = upload(s3_env, ckpt, "mr-ckpts/legacy")
    fetched, whole = s3_reads

    merge_checkpoint(source, tmp_path / "remote", dtype="bf16")

    assert_same_folders(tmp_path / "local", tmp_path / "remote")
    rank_files = sorted((ckpt.role_dir / "model").glob("mp_rank_*/model.pt"))
    assert len(rank_files) == 2
    assert not [k for k in whole if k.endswith(".pt")]  # no rank file downloaded whole
    for path in rank_files:
        key = f"{source[5:]}/model/{path.parent.name}/model.pt"
        spans = optimizer_spans(path)
        optimizer_bytes = sum(e - s for s, e in spans)
        assert len(spans) >= 2 and optimizer_bytes > path.stat().st_size / 2  # the fixture holds optimizer state
        assert overlapping(s3_ranges, key, spans) == []  # zero bytes of optimizer members
        # the model's bytes and the archive's own records (a joined request may bring a header twice)
        assert fetched[key] <= 1.02 * (path.stat().st_size - optimizer_bytes)


def test_dist_ckpt_from_s3_reads_model_boxes_only(s3_env, s3_reads, s3_ranges, dist_with_optimizer, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from mergecore import merge_checkpoint

    ckpt = dist_with_optimizer
    dist = ckpt.role_dir / "model" / "dist_ckpt"
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "local", dtype="keep")
    source = upload(s3_env, ckpt, "mr-ckpts/dist")
    fetched, whole = s3_reads

    merge_checkpoint(source, tmp_path / "remote", dtype="keep")

    assert_same_folders(tmp_path / "local", tmp_path / "remote")
    assert not [k for k in whole if k.endswith(".distcp")]  # data files only by range
    assert not [k for k in fetched if "/optimizer/" in k or "/extra/" in k]  # the optimizer's folder: never opened
    storage = FileSystemReader(str(dist)).read_metadata().storage_data  # plain pickle: fine for our own fixture
    optimizer = {}
    for index, info in storage.items():
        if index.fqn == OPTIMIZER_KEY:
            optimizer.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    assert optimizer, "the fixture holds an optimizer box in the model's .distcp files"
    model_bytes = {}
    for index, info in storage.items():
        if not index.fqn.startswith("optimizer.") and "_extra_state" not in index.fqn:
            model_bytes[info.relative_path] = model_bytes.get(info.relative_path, 0) + info.length
    for name, spans in optimizer.items():
        key = f"{source[5:]}/model/dist_ckpt/{name}"
        assert fetched[key] > 0 and overlapping(s3_ranges, key, spans) == []  # zero bytes of optimizer boxes
        assert fetched[key] <= model_bytes[name]  # the model's boxes, nothing more


def test_ranges_are_never_joined_across_a_kept_out_span(s3_env, s3_ranges):
    """Megatron interleaves what must not be read (optimizer items, in some layouts) with model tensors:
    two wanted ranges 1 KiB apart are one request, unless the bytes between are kept out."""
    from mergecore.storage import Location, RangeFile

    s3_env.mkdir("mr-fence")
    s3_env.pipe_file("mr-fence/joined", bytes(range(256)) * 12)
    s3_env.pipe_file("mr-fence/fenced", bytes(range(256)) * 12)
    joined = RangeFile.of(Location.of("s3://mr-fence/joined"))
    fenced = RangeFile.of(Location.of("s3://mr-fence/fenced"))
    fenced.keep_out([(1024, 2048)])

    assert joined.fetch([(0, 1024), (2048, 3072)]) == 3072
    assert fenced.fetch([(0, 1024), (2048, 3072)]) == 2048
    assert sorted((s, e) for k, s, e in s3_ranges if k == "mr-fence/fenced") == [(0, 1024), (2048, 3072)]
    assert [(s, e) for k, s, e in s3_ranges if k == "mr-fence/joined"] == [(0, 3072)]
    with open(fenced.path, "rb") as f:
        data = f.read()
    assert data[:1024] + data[2048:] == (bytes(range(256)) * 12)[:1024] + (bytes(range(256)) * 12)[2048:]
    assert data[1024:2048] == bytes(1024)  # never fetched
