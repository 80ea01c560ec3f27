"""Object storage in and out: rank files read by byte range, models published on S3 (moto) manifest last.

Bytes are counted at s3fs's boundary (its `_cat_file` / `_get_file`, what every ranged or whole GET goes
through), never inside ckptflow.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from helpers import objects, rank_file_bytes, upload

s3fs = pytest.importorskip("s3fs")

MANIFEST = "ckptflow_manifest.json"


def test_s3_to_s3_merge_is_byte_identical_and_reads_no_optimizer_byte(s3_env, s3_reads, demo, tmp_path):
    from mergecore import merge_checkpoint
    from mergecore.storage.ledger import public_name

    ckpt = demo("fsdp2-w2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "local", dtype="bf16")
    source = upload(s3_env, ckpt, "io-ckpts/io1")
    fetched, whole = s3_reads

    manifest = merge_checkpoint(source, "s3://io-models/io1", dtype="bf16")

    remote = objects(s3_env, "io-models/io1")
    local = {p.relative_to(tmp_path / "local").as_posix(): p.read_bytes() for p in (tmp_path / "local").rglob("*") if p.is_file()}
    assert set(remote) == set(local)
    for name in set(local) - {MANIFEST, "README.md"}:  # the manifest names the source URL and timings
        assert remote[name] == local[name], name
    shown = public_name(str(ckpt.role_dir)).encode()  # the card names its source publicly (storage/ledger.py)
    assert remote["README.md"] == local["README.md"].replace(shown, source.encode())  # the card too
    assert json.loads(remote[MANIFEST])["files"] == manifest["files"]
    local_entries = json.loads(local[MANIFEST])["files"]
    for name in set(local) - {MANIFEST, "README.md"}:
        assert {k: manifest["files"][name][k] for k in ("sha256", "size")} == \
            {k: local_entries[name][k] for k in ("sha256", "size")}, name
    rank_keys = [k for k in fetched if "/model_world_size_" in k]
    assert len(rank_keys) == 2 and not [k for k in whole if "model_world_size" in k]  # only ranged GETs
    assert not [k for k in fetched if "/optim_" in k or "/extra_state_" in k]  # zero optimizer bytes
    assert not (tmp_path / "cache" / "targets").exists()  # nothing was assembled on local disk
    assert not [k for k in objects(s3_env, "io-models/io1") if k.startswith(".ckptflow-staging")]  # records gone


def test_one_group_fetches_its_own_byte_ranges_only(s3_env, s3_reads, demo, tmp_path, monkeypatch):
    from mergecore import merge_group, prepare
    from mergecore.engine.writer import prepare_files

    monkeypatch.setenv("CKPTFLOW_RANGE_GAP", "0")  # tiny tensors: by default neighbours come in the same request
    ckpt = demo("fsdp2-w2")
    source = upload(s3_env, ckpt, "io-ckpts/io2")
    prepared = prepare(source, dtype="keep")
    fetched, _ = s3_reads
    after_prepare = collections.Counter(fetched)
    group = prepared.plan.groups[1]  # one decoder layer
    names = [t.name for t in prepared.plan.in_group(group)]
    prepare_files(prepared.plan, tmp_path / "staging")
    merge_group(prepared.source, prepared.plan, group, tmp_path / "staging")

    for rank, read_for_group in enumerate(read_since(fetched, after_prepare, "io-ckpts/io2")):
        assert_just_the_bytes_of(names, read_for_group, rank_file_bytes(ckpt, names, [rank]))
        assert read_for_group < 0.5 * next(ckpt.role_dir.glob(f"model_world_size_2_rank_{rank}.pt")).stat().st_size


@pytest.mark.parametrize("fixture, options, first, other", [
    # the final norm's file does not hold lm_head, the rest of its layer group
    ("fsdp2-w2-vocab8k", {"dtype": "keep"}, "model.norm.weight", "lm_head.weight"),
    # quantized: the file of layer 0's first weight (its parts) does not hold layer 0's MLP
    ("quant-dense-tied", {"dtype": "bf16", "quantize": "fp8-block"}, "model.layers.0.self_attn.q_proj.weight",
     "model.layers.0.mlp.down_proj.weight"),
])
def test_one_output_file_fetches_its_own_tensors_only(s3_env, s3_reads, demo, monkeypatch, fixture, options, first,
                                                      other):
    """A file holding part of a layer group reads its own tensors' bytes, never the rest of the group's: what a
    worker streaming that file to object storage downloads is that file's tensors (a quantized part's: its
    weight's)."""
    from mergecore import prepare
    from mergecore.engine.remote_writer import write_remote_file

    monkeypatch.setenv("CKPTFLOW_RANGE_GAP", "0")  # tiny tensors: by default neighbours come in the same request
    ckpt = demo(fixture)
    prefix = f"io-ckpts/io-file-{fixture}"
    prepared = prepare(upload(s3_env, ckpt, prefix), max_shard_size="64KB", **options)
    plan = prepared.plan
    source_of = {t.name: t.source_name or t.name for t in plan.tensors}
    file_of = {source_of[t.name]: t.file for t in plan.tensors}
    file = file_of[first]
    names = sorted({source_of[t.name] for t in plan.in_file(file)})
    assert file_of[other] != file  # ... of the same layer group:
    assert len({t.group for t in plan.tensors if source_of[t.name] in (first, other)}) == 1
    fetched, _ = s3_reads
    before = collections.Counter(fetched)

    write_remote_file(prepared.source, plan, file, f"s3://io-models/io-file-{fixture}")  # no proof: no read back

    for rank, read_for_file in enumerate(read_since(fetched, before, prefix)):
        assert_just_the_bytes_of(names, read_for_file, rank_file_bytes(ckpt, names, [rank]))


def read_since(fetched, before, prefix: str) -> list[int]:
    """Bytes fetched of each of the two rank files under `prefix` since `before` was counted."""
    keys = [f"{prefix}/global_step_1/actor/model_world_size_2_rank_{rank}.pt" for rank in range(2)]
    return [fetched[key] - before[key] for key in keys]


def assert_just_the_bytes_of(names, read: int, held: int) -> None:
    """`read` is the `held` bytes of tensors `names`, less what came with each member's header (<= 256 bytes)."""
    assert held - 256 * len(names) <= read <= held, (read, held, names)


@pytest.fixture
def published(s3_env, demo, cli):
    import uuid

    ckpt, name = demo("fsdp2-w2"), f"io3-{uuid.uuid4().hex[:8]}"
    source = upload(s3_env, ckpt, f"io-ckpts/{name}")
    result = cli("merge", "--local_dir", source, "--target_dir", f"s3://io-models/{name}", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert f"s3://io-models/{name}" in result.output
    return f"s3://io-models/{name}"


def source_of(published: str) -> str:
    return f"s3://io-ckpts/{published.rsplit('/', 1)[1]}/global_step_1/actor"


def test_verify_reads_a_remote_model_and_detects_a_tampered_file(s3_env, published, cli):
    result = cli("verify", published, "--source", source_of(published))  # an s3:// source only when passed
    assert result.exit_code == 0, result.output
    assert "round-trip" in result.output

    weights = [p for p in s3_env.find(published[5:]) if p.endswith(".safetensors")][0]
    data = bytearray(s3_env.cat_file(weights))
    data[-1] ^= 0x01  # one bit of the last weight
    s3_env.pipe_file(weights, bytes(data))
    result = cli("verify", published, "--skip-source")
    assert result.exit_code != 0
    assert Path(weights).name in result.output and "differs" in result.output


def test_a_crash_before_the_manifest_leaves_no_visible_model(s3_env, published, demo, cli, monkeypatch):
    from mergecore import CheckpointError, merge_checkpoint
    from mergecore import open_target

    put = s3fs.S3FileSystem._put_file

    async def dies_at_the_manifest(self, lpath, rpath, **kwargs):
        if rpath.endswith(MANIFEST):
            raise RuntimeError("killed before the manifest")  # as if the process died here
        return await put(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", dies_at_the_manifest)
    s3fs.S3FileSystem.clear_instance_cache()  # instances bind their sync methods when made
    # Overwriting the published model with a different merge (fp32): the old manifest goes first.
    with pytest.raises(RuntimeError, match="killed before the manifest"):
        merge_checkpoint(source_of(published), published, dtype="float32", overwrite=True)
    left = objects(s3_env, published[5:])
    assert MANIFEST not in left and any(name.endswith(".safetensors") for name in left)  # files, but no model
    records = {name: json.loads(data)["receipt"] for name, data in left.items() if name.startswith(".ckptflow-staging/")}
    assert sorted(records) == sorted(f".ckptflow-staging/{n}.json" for n in left if n.endswith(".safetensors"))
    with pytest.raises(CheckpointError, match="no published model"):
        with open_target(published).local_copy():
            pass
    result = cli("verify", published)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", put)
    s3fs.S3FileSystem.clear_instance_cache()
    manifest = merge_checkpoint(source_of(published), published, dtype="float32", overwrite=True)
    assert manifest["dtype"] == "float32"
    assert manifest["groups_written"] == list(records.values())  # the files written before the crash were kept
    assert cli("verify", published, "--source", source_of(published)).exit_code == 0


def test_promotion_from_s3_to_s3_equals_the_local_merge(prefect_server, s3_env, demo, cli, tmp_path):
    ckpt = demo("fsdp2-w2")
    source = upload(s3_env, ckpt, "io-ckpts/io4")
    assert cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", tmp_path / "local").exit_code == 0

    result = cli("promote", source, "--target", "s3://io-models/io4")
    assert result.exit_code == 0, result.output
    assert "verified model: s3://io-models/io4" in result.stdout

    remote = objects(s3_env, "io-models/io4")
    for path in (tmp_path / "local").glob("*.safetensors"):
        assert remote[path.name] == path.read_bytes(), path.name
    assert MANIFEST in remote and cli("verify", "s3://io-models/io4", "--source", source).exit_code == 0

    rerun = cli("promote", source, "--target", "s3://io-models/io4")  # the target holds this merge: nothing runs
    assert rerun.exit_code == 0, rerun.output
    assert "manifest (size)" in rerun.stdout and "files reused from cache" in rerun.stdout
    assert objects(s3_env, "io-models/io4") == remote


@pytest.mark.parametrize("scheme", ["fp8-block", "w4a16"])
def test_a_quantized_merge_to_s3_is_the_local_one_and_verifies(s3_env, demo, cli, tmp_path, scheme):
    """`--quantize` to object storage (was refused): each file streamed with its weights' parts in order, read back
    and proven (re-quantized, decoded within the bound), the objects byte for byte the local merge's files; `verify`
    re-proves the stored model and refuses one whose quantized bytes were changed."""
    ckpt = demo("quant-dense-tied")
    shards = ("--max-shard-size", "64KB")  # several files, some holding a weight's parts and plain tensors
    local = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", tmp_path / "local", "--quantize", scheme, *shards)
    assert local.exit_code == 0, local.output
    name = f"io-q-{scheme}"
    source = upload(s3_env, ckpt, f"io-ckpts/{name}")
    remote = cli("merge", "--local_dir", source, "--target_dir", f"s3://io-models/{name}", "--quantize", scheme, *shards)
    assert remote.exit_code == 0, remote.output

    stored = objects(s3_env, f"io-models/{name}")
    files = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir() if p.name not in (MANIFEST, "README.md")}
    assert len([n for n in files if n.endswith(".safetensors")]) > 2
    assert {n: stored[n] for n in files} == files  # weights, index, config with its quantization_config
    record = next(r for r in json.loads(stored[MANIFEST])["verification"] if r["check"] == "round-trip")
    local_record = next(r for r in json.loads((tmp_path / "local" / MANIFEST).read_text())["verification"]
                        if r["check"] == "round-trip")
    assert {k: record[k] for k in ("scheme", "quantized", "max_abs_error", "max_error_vs_bound")} == \
        {k: local_record[k] for k in ("scheme", "quantized", "max_abs_error", "max_error_vs_bound")}
    assert record["quantized"] > 0 and record["max_error_vs_bound"] <= 1

    checked = cli("verify", f"s3://io-models/{name}", "--source", source)
    assert checked.exit_code == 0, checked.output
    assert f"scheme={scheme}" in checked.stdout
    packed = "weight" if scheme == "fp8-block" else "weight_packed"
    index = json.loads(stored["model.safetensors.index.json"])["weight_map"]
    victim = index[f"model.layers.0.mlp.down_proj.{packed}"]
    data = bytearray(stored[victim])
    data[-1] ^= 0x01  # the last byte of the file's last tensor
    s3_env.pipe_file(f"io-models/{name}/{victim}", bytes(data))
    assert cli("verify", f"s3://io-models/{name}", "--skip-source").exit_code != 0  # the manifest's sha256 says so
