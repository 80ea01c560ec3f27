"""Checkpoints behind an fsspec URL: S3 through s3fs against a local moto server."""

from __future__ import annotations

import socket

import pytest

from mergecore import compare_with_reference, merge_checkpoint

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3_endpoint)  # fsspec passes it to s3fs as endpoint_url
    monkeypatch.setenv("CKPTFLOW_CACHE", str(tmp_path / "cache"))
    import fsspec.config

    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fsspec.config.conf.clear()


def test_merge_from_s3_run_root(s3_env, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    s3_env.mkdir("ckpts")
    s3_env.put(str(ckpt.run_root / "latest_checkpointed_iteration.txt"), "ckpts/run1/latest_checkpointed_iteration.txt")
    s3_env.put(str(ckpt.run_root / "global_step_1"), "ckpts/run1/global_step_1", recursive=True)

    manifest = merge_checkpoint("s3://ckpts/run1", tmp_path / "out", dtype="keep")
    assert manifest["source"]["location"] == "s3://ckpts/run1/global_step_1/actor"
    assert manifest["source"]["step"] == 1
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (ckpt.role_dir / "huggingface" / "tokenizer.json").read_bytes()
