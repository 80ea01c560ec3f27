"""Shared fixtures: real verl FSDP checkpoints written once per test session by real torch.distributed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.testing.demo_checkpoint import DemoCheckpoint, DemoSpec, write_demo_checkpoints
from helpers import free_port

# One checkpoint per way verl can save an FSDP model (see docs/facts.md).
VARIANTS = {
    "fsdp2-w1": DemoSpec(world_size=1),
    "fsdp2-w2": DemoSpec(world_size=2),
    # vocab 1001 over 4 ranks: uneven Shard(0) rows 251, 251, 251, 248
    "fsdp2-w4-llama-tied": DemoSpec(arch="llama", world_size=4, tie_word_embeddings=True),
    # verl's placement function: Shard(1) where dim 0 is not divisible by 4
    "fsdp2-w4-placement": DemoSpec(world_size=4, shard_placement_fn=True),
    "hsdp-2x2": DemoSpec(mode="hsdp", world_size=4),
    "fsdp1-mesh-llama": DemoSpec(arch="llama", mode="fsdp1_mesh", world_size=2),
    "fsdp1-sharded-tensor-tied": DemoSpec(mode="fsdp1", world_size=2, tie_word_embeddings=True),
    "critic-w2": DemoSpec(arch="critic", world_size=2),
    "single-llama": DemoSpec(arch="llama", mode="single", world_size=1),
    "fsdp2-w2-llama-tied-placement": DemoSpec(arch="llama", tie_word_embeddings=True, shard_placement_fn=True),
}
# Model families transformers keeps in memory in another layout than on the Hub, and LoRA: tested in files of their own.
FAMILIES = {
    "qwen3_moe": DemoSpec(arch="qwen3_moe"),
    "qwen2_moe": DemoSpec(arch="qwen2_moe"),
    "mixtral": DemoSpec(arch="mixtral"),
    "qwen2_5_vl": DemoSpec(arch="qwen2_5_vl"),
    "qwen3_vl": DemoSpec(arch="qwen3_vl"),
    "gemma3_text": DemoSpec(arch="gemma3_text"),
    "qwen3_next": DemoSpec(arch="qwen3_next"),
    "sarvam_moe": DemoSpec(arch="sarvam_moe"),  # q/k/v joined into one saved tensor: tests/core/views/test_hub_boxes.py
    "lora-full": DemoSpec(lora=True),
    "lora-only": DemoSpec(lora=True, lora_only=True),
    "lora-moe": DemoSpec(arch="qwen3_moe", lora=True),
}

# Weights that outweigh the rank files' pickles, as in real models (the default vocab's are ~20% pickle): for
# tests that count who read which bytes.
WEIGHT_HEAVY = {"fsdp2-w2-vocab8k": DemoSpec(vocab_size=8192)}

# Dims that are multiples of 128, as quantized exports need (tests/core/quantize/test_quantize.py): dense (tied), MoE.
QUANTIZABLE = {
    "quant-dense-tied": DemoSpec(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                                 tie_word_embeddings=True),
    "quant-moe": DemoSpec(arch="qwen3_moe", hidden_size=128, intermediate_size=512, num_attention_heads=2,
                          num_key_value_heads=2),
    # LoRA fused then quantized (tests/core/quantize/test_quantize_sources.py): the LoRA fixtures' hidden 64 is too small
    "quant-lora": DemoSpec(lora=True, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=2),
}

# For the engine check in vLLM (tests/core/serving/): head size 64 and dims of 128, bias-free, so every scheme runs on
# vLLM's CPU backend; and a config vLLM reads differently from transformers (head_dim 32 beside hidden 64, 4 heads).
SERVABLE = {
    "engine-llama": DemoSpec(arch="llama", hidden_size=128, intermediate_size=256, num_attention_heads=2,
                             num_key_value_heads=2),
    "engine-misread-head-dim": DemoSpec(head_dim=32),
}

# Torch distributed checkpoints (tests/core/formats/test_dcp.py): the model trained one step (TP: noise instead),
# saved by torch's `dcp.save` of `get_model_state_dict` as a plain folder and in torchtitan's layout, and by
# Accelerate's own `Accelerator.save_state`.
DCP = {
    "dcp-fsdp2": DemoSpec(arch="llama", save="dcp"),
    "dcp-fsdp2-w3": DemoSpec(arch="llama", world_size=3, save="dcp"),  # vocab 1001 over 3: uneven boxes
    "dcp-torchtitan": DemoSpec(arch="llama", save="torchtitan"),
    "dcp-accelerate": DemoSpec(save="accelerate"),
    "dcp-hsdp": DemoSpec(arch="llama", mode="hsdp", world_size=4, save="dcp"),
    "dcp-fsdp2-tp": DemoSpec(arch="llama", mode="fsdp2_tp", world_size=4, save="torchtitan"),
}

ALL = {**VARIANTS, **FAMILIES, **WEIGHT_HEAVY, **QUANTIZABLE, **SERVABLE, **DCP}


@pytest.fixture(scope="session", autouse=True)
def config_check_cache(tmp_path_factory):
    """The config check's answers (`mergecore.families.config_check`) kept for this session only, not in ~/.cache."""
    import os

    before = os.environ.get("CKPTFLOW_CONFIG_CACHE")
    os.environ["CKPTFLOW_CONFIG_CACHE"] = str(tmp_path_factory.mktemp("ckptflow-config-cache"))
    yield
    if before is None:
        os.environ.pop("CKPTFLOW_CONFIG_CACHE")
    else:
        os.environ["CKPTFLOW_CONFIG_CACHE"] = before


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`demo(name)` -> DemoCheckpoint for one of VARIANTS or FAMILIES, written on first use, together with every other FSDP2
    variant of the same world size (one start of the rank processes for all: most of a tiny checkpoint's cost)."""
    made: dict[str, DemoCheckpoint] = {}

    def get(name: str) -> DemoCheckpoint:
        if name not in made:
            spec = ALL[name]
            together = [other for other, s in ALL.items() if other not in made and s.mode == "fsdp2"
                        and s.world_size == spec.world_size] if spec.mode == "fsdp2" else [name]
            folders = {other: tmp_path_factory.mktemp(other) for other in together}
            written = write_demo_checkpoints({folders[other]: ALL[other] for other in together})
            made.update({other: written[folders[other]] for other in together})
        return made[name]

    return get


TORCHTITAN_SITE = Path(__file__).resolve().parent.parent / ".venv" / "torchtitan"  # ./dev test installs it


@pytest.fixture(scope="session")
def titan(tmp_path_factory):
    """`titan(model)` -> (run folder, reference folder) of a checkpoint of torchtitan's own `model` ("llama3",
    "qwen3", "qwen3_moe", "deepseek_v3"; "llama3_tp": FSDP2 x TP on four ranks) written by torchtitan's CheckpointManager (tests/torchtitan_save.py), once per session."""
    import os
    import subprocess
    import sys

    if not (TORCHTITAN_SITE / "torchtitan").is_dir():
        pytest.skip("torchtitan is not installed: ./dev test installs it into .venv/torchtitan")
    made: dict[str, tuple[Path, Path]] = {}

    def get(model: str) -> tuple[Path, Path]:
        if model not in made:
            out = tmp_path_factory.mktemp(f"torchtitan-{model}")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TORCHTITAN_SITE),
                                                                             os.environ.get("PYTHONPATH")]))}
            done = subprocess.run([sys.executable, str(Path(__file__).parent / "torchtitan_save.py"), str(out),
                                   "--model", model], env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            made[model] = (out / "run", out / "reference")
        return made[model]

    return get


@pytest.fixture
def demo_copy(demo, tmp_path):
    """`demo_copy(name)` -> a private copy of a demo run that a test may damage."""

    return lambda name: copy_run(demo(name), tmp_path / name)


def copy_run(original, root: Path):
    """A copy of a fixture run (run_root, role_dir, reference_dir) at `root`, of the same type."""
    shutil.copytree(original.run_root, root)
    relocate = lambda p: root / Path(p).relative_to(original.run_root)  # noqa: E731
    return type(original)(root, relocate(original.role_dir), relocate(original.reference_dir))


@pytest.fixture
def cli():
    """Run `ckptflow ARGS...` in-process; returns click's Result (exit_code, stdout, stderr)."""
    from ckptflow.flows.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A loopback Hub speaking the real HTTP protocol; HF_TOKEN is alice's token."""
    from hub_server import HubServer

    with HubServer(tokens={"hf_alice": "alice", "hf_bob": "bob"}) as server:
        server.configure_client(monkeypatch, tmp_path / "hf-home")
        monkeypatch.setenv("HF_TOKEN", "hf_alice")
        yield server


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect API (temporary SQLite database) for the flow tests of this session."""
    from prefect.testing.utilities import prefect_test_harness

    from ckptflow.flows.settings import in_process_settings

    with in_process_settings(), prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback for the tests of one module; its URL."""
    import logging

    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    # Its request lines would reach the root logger's handlers: Prefect's console handler, bound to the stderr
    # of whichever CLI call configured it (a CliRunner stream closed since), breaking later one-line asserts.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # moto keeps its buckets in process-wide state, not per server: without a reset, a bucket made by an earlier
    # module's server is still there, and a test that creates it fails depending on the order modules ran in.
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST")).close()
    yield url
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch, tmp_path):
    """s3fs (through fsspec's configuration) pointed at the moto server; yields a client of it."""
    s3fs = pytest.importorskip("s3fs")
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


@pytest.fixture
def s3_reads():
    """Bytes s3fs returned per object key, and the keys fetched whole (a GET without a range)."""
    from ckptflow.testing.s3_reads import counting

    with counting() as (fetched, whole):
        yield fetched, whole
