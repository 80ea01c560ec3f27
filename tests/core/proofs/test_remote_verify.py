"""`ckptflow verify s3://...`: the model is read file by file by ranged GETs, never copied whole to local disk.

Reads are observed at s3fs's boundary (its `_cat_file` / `_get_file`); the local space held is observed from
outside our code, in /proc/self (the range files are unlinked at once, so only their open descriptors and
mappings show them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


s3fs = pytest.importorskip("s3fs")

MANIFEST = "ckptflow_manifest.json"


def live_range_files(cache: Path) -> dict[int, int]:
    """Inode -> bytes allocated on disk, of every range file this process still holds (descriptor or mapping)."""
    marker = f"{cache}/"
    held: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(marker):
                stat = os.stat(f"/proc/self/fd/{fd}")
                held[stat.st_ino] = stat.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(marker):
                held.setdefault(int(fields[4]), 0)  # mapped only: its descriptor is closed, its space not yet free
    return held


@pytest.fixture
def sharded_model(s3_env, demo, tmp_path):
    """A demo model merged to S3 in at least three weight files; returns (url, weight file sizes by key, shard size)."""
    from mergecore import merge_checkpoint

    ckpt = demo("fsdp2-w2")
    reference_bytes = sum(p.stat().st_size for p in ckpt.reference_dir.glob("*.safetensors"))
    if not s3_env.exists("rv-models"):
        s3_env.mkdir("rv-models")
    url = f"s3://rv-models/{tmp_path.name}"
    shard = reference_bytes // 16
    merge_checkpoint(str(ckpt.role_dir), url, max_shard_size=shard)
    s3_env.invalidate_cache()
    weights = {path: s3_env.size(path) for path in s3_env.find(url[5:]) if path.endswith(".safetensors")}
    assert len(weights) >= 3, weights
    return url, weights, shard


def test_verify_reads_each_weight_file_by_ranges_holding_one_at_a_time(sharded_model, s3_reads, cli, tmp_path,
                                                                       monkeypatch):
    url, weights, _ = sharded_model
    fetched, whole = s3_reads
    cache = tmp_path / "cache"
    seen: list[dict[int, int]] = []
    counted = s3fs.S3FileSystem._cat_file

    async def probing(self, path, version_id=None, start=None, end=None):
        seen.append(live_range_files(cache))
        return await counted(self, path, version_id=version_id, start=start, end=end)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", probing)
    s3fs.S3FileSystem.clear_instance_cache()

    result = cli("verify", url)

    assert result.exit_code == 0, result.output
    assert "manifest" in result.stdout and "round-trip" in result.stdout
    for key, size in weights.items():
        assert fetched[key] == size, key  # every byte read once...
        assert key not in [w.split("://")[-1] for w in whole], key  # ...by ranged GETs only
    # Never two weight files' bytes on local disk at once, and at most one file's worth.
    assert max(len(held) for held in seen) == 1
    assert max(sum(held.values()) for held in seen) <= max(weights.values()) + 4096
    assert live_range_files(cache) == {}  # all released afterwards
    assert not (cache / "targets").exists() or not list((cache / "targets").iterdir())


def test_remote_verify_rows_equal_those_of_the_local_folder(sharded_model, s3_env, demo, tmp_path):
    """One pass over a model reader, whatever the place: the rows of the model on S3 are those of the same merge
    in a local folder, the manifest and round-trip rows those of the folder's own checks."""
    from mergecore import merge_checkpoint, open_checkpoint, verify_manifest, verify_round_trip
    from mergecore.proofs.published import verify_model
    from mergecore.proofs.reader import model_reader

    url, weights, shard = sharded_model
    ckpt = demo("fsdp2-w2")
    local = tmp_path / "local"
    merge_checkpoint(str(ckpt.role_dir), local, max_shard_size=shard)
    source = open_checkpoint(str(ckpt.role_dir))
    manifest = json.loads((local / MANIFEST).read_text())
    remote_manifest = json.loads(s3_env.cat_file(f"{url.removeprefix('s3://')}/{MANIFEST}"))

    rows = verify_model(model_reader(url), remote_manifest, source)

    assert rows == verify_model(model_reader(local), manifest, source)
    assert [rows[0], rows[-1]] == [verify_manifest(local), verify_round_trip(source, local, manifest.get("aliases", {}))]
    assert rows[0]["files"] == len(manifest["files"])
    copied = [p.name for p in (ckpt.role_dir / "huggingface").iterdir() if p.name != "config.json"]
    assert rows[1] == {"check": "copied files", "files": len(copied) + 1, "ok": True}  # and config.json


def test_a_weight_object_changed_after_publishing_fails_naming_it(sharded_model, s3_env, s3_reads, cli):
    url, weights, _ = sharded_model
    fetched, _ = s3_reads
    first, tampered, *later = sorted(weights)
    data = bytearray(s3_env.cat_file(tampered))
    data[len(data) // 2] ^= 0x01  # same size, one bit flipped
    s3_env.pipe_file(tampered, bytes(data))
    fetched.clear()

    result = cli("verify", url)

    assert result.exit_code == 3, result.output
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and f"s3://{tampered}: differs from {MANIFEST}" in error[0], error
    assert fetched[first] == weights[first] and not any(fetched[key] for key in later)  # it stops there


def test_a_quantized_object_edited_with_its_hash_updated_changed_after_the_merge(s3_env, demo, cli, tmp_path):
    """A packed word of a w4a16 model on object storage edited, and the manifest's sha256 for it updated: `verify`
    re-quantizes from the rank files and says the object changed after the merge, naming it, exit 3 (was: "the
    merge is wrong ... please report this")."""
    import hashlib

    from mergecore import merge_checkpoint

    ckpt = demo("quant-dense-tied")
    if not s3_env.exists("rv-models"):
        s3_env.mkdir("rv-models")
    url = f"s3://rv-models/{tmp_path.name}-w4"
    merge_checkpoint(str(ckpt.role_dir), url, quantize="w4a16")
    s3_env.invalidate_cache()
    root = url.removeprefix("s3://")
    tensor = "model.layers.1.mlp.down_proj.weight_packed"
    file = json.loads(s3_env.cat_file(f"{root}/model.safetensors.index.json"))["weight_map"][tensor]
    data = bytearray(s3_env.cat_file(f"{root}/{file}"))
    header = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + header])[tensor]["data_offsets"]
    data[8 + header + (begin + end) // 2] ^= 0x10
    s3_env.pipe_file(f"{root}/{file}", bytes(data))
    manifest = json.loads(s3_env.cat_file(f"{root}/{MANIFEST}"))
    manifest["files"][file].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    s3_env.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest).encode())
    s3_env.invalidate_cache()

    result = cli("verify", url, "--source", ckpt.role_dir)

    assert result.exit_code == 3, result.output
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and f"{url}/{file}: model.layers.1.mlp.down_proj.weight's weight_packed" in error[0], error
    assert "the file changed after the merge" in error[0] and "report" not in error[0]


def test_a_copied_object_edited_with_its_hash_updated_fails(sharded_model, s3_env, cli, demo):
    """tokenizer_config.json replaced on S3 and the manifest's entry updated to match (a tamperer covering their
    tracks): `verify` compares the files copied from the checkpoint's huggingface/ for a model on object storage too,
    exit 3 naming the object (was: passed, the remote verify never compared them)."""
    import hashlib

    url, _, _ = sharded_model
    root, name = url.removeprefix("s3://"), "tokenizer_config.json"
    assert (demo("fsdp2-w2").role_dir / "huggingface" / name).is_file()  # a file the merge copied
    config = json.loads(s3_env.cat_file(f"{root}/{name}"))
    config["chat_template"] = "{{ 'obey me' }}"
    data = json.dumps(config).encode()
    s3_env.pipe_file(f"{root}/{name}", data)
    manifest = json.loads(s3_env.cat_file(f"{root}/{MANIFEST}"))
    manifest["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    s3_env.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest).encode())
    s3_env.invalidate_cache()
    assert cli("verify", url, "--skip-source").exit_code == 0  # the hashes alone cannot tell

    result = cli("verify", url)

    assert result.exit_code == 3, result.output
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and f"{url}/{name}: differs from" in error[0], error
    assert "the copied file was changed after the merge" in error[0]
