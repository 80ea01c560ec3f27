"""One typed request built at the edge; the promotion DAG passing data; one open of the checkpoint per promotion;
the public API's examples running unskipped."""

from __future__ import annotations

import builtins
import collections
import doctest
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import mergecore
from mergecore import CheckpointError, MergeRequest

ROOT = Path(__file__).resolve().parent.parent


# ---- the request refuses bad values, in one line, before anything is opened

BAD = [
    (["--dtype", "bf17"], "unknown --dtype 'bf17'"),
    (["--max-shard-size", "0"], "--max-shard-size '0'"),
    (["--max-shard-size", "five gigs"], "is not a size"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite 'ignore'"),
    (["--workers", "0"], "--workers 0"),
    (["--lora", "fused"], "--lora fused: choose one of"),
    (["--lora-alpha", "-1"], "--lora-alpha -1"),
]


@pytest.mark.parametrize("flags, says", BAD)
def test_merge_refuses_a_bad_value_before_opening_the_checkpoint(cli, tmp_path, flags, says):
    # the checkpoint does not exist: the old code opened it first and reported that instead
    result = cli("merge", "--local_dir", tmp_path / "no-such-checkpoint", "--target_dir", tmp_path / "out", *flags)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and "no-such-checkpoint" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, says", [*BAD[:4], *BAD[5:], (["--quantize", "int4"], "unknown --quantize 'int4'")])
def test_promote_refuses_a_bad_value_before_a_flow_run_starts(prefect_server, cli, tmp_path, flags, says):
    """The request was built inside the flow: each bad value became a failed flow run (and, with no server set, a
    temporary server started for it and Prefect's traceback in the output)."""
    from prefect.client.orchestration import get_client

    def flow_runs() -> int:
        with get_client(sync_client=True) as client:
            return len(client.read_flow_runs(limit=200))

    before = flow_runs()
    result = cli("promote", tmp_path / "no-such-checkpoint", "--target", tmp_path / "out", *flags)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert flow_runs() == before and not (tmp_path / "out").exists()


def test_promote_with_a_bad_quantize_prints_one_line_without_a_server(tmp_path):
    """As a user runs it, no Prefect server set: one line on stderr, nothing on stdout, no traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path / "p")}
    done = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "promote", str(tmp_path / "ckpt"), "--target",
                           str(tmp_path / "out"), "--quantize", "int4"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: unknown --quantize 'int4': use fp8-block, w8a16 or w4a16", done.stderr


def test_a_failed_run_logs_our_error_in_one_line_without_a_traceback(prefect_server, cli, tmp_path):
    """Prefect logs the exception that ends a task or flow run with its traceback: for a missing checkpoint the
    console showed three tracebacks above the CLI's one line."""
    import logging

    records: list[logging.LogRecord] = []

    def record(entry: logging.LogRecord) -> bool:  # a filter, as Prefect's logging set-up drops added handlers
        records.append(entry)
        return True

    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addFilter(record)  # after ckptflow.flows' own: it sees what the handlers get
    try:
        result = cli("promote", tmp_path / "no-such-checkpoint", "--target", tmp_path / "out")
    finally:
        for logger in loggers:
            logger.removeFilter(record)
    assert result.exit_code == 2 and "no-such-checkpoint: does not exist" in result.stderr
    reported = [r for r in records if "no-such-checkpoint: does not exist" in r.getMessage()]
    assert {r.name for r in reported} == {"prefect.flow_runs", "prefect.task_runs"}  # Prefect's lines are kept
    assert not [r for r in reported if r.exc_info or r.exc_text]


def test_the_request_checks_each_part_when_built():
    with pytest.raises(CheckpointError, match="unknown --dtype 'fp8'"):
        MergeRequest.of("ckpts/run1", dtype="fp8")
    with pytest.raises(CheckpointError, match="not with --custom-mapping"):
        MergeRequest.of("ckpts/run1", custom_mapping="map.yaml", lora={"alpha": 16.0})
    with pytest.raises(TypeError, match="unknown option 'dtpye'"):
        MergeRequest.of("ckpts/run1", dtpye="bf16")


def test_the_request_travels_as_json():
    request = MergeRequest.of("s3://ckpts/run1", "out/model", dtype="bf16", overwrite=True, chunk_bytes="16MB",
                              lora={"output": "fuse", "alpha": 32.0, "r": 8})
    again = MergeRequest.from_dict(json.loads(json.dumps(request.to_dict())))
    assert again == request and again.what.lora.alpha == 32.0 and again.where.overwrite is True
    assert pickle.loads(pickle.dumps(request)) == request  # as Dask ships it


# ---- the DAG carries data

@pytest.fixture
def steps(demo, tmp_path):
    """The first four tasks of a promotion run as plain functions, each fed the previous one's result."""
    from ckptflow.tasks import discover_shards, plan_groups, prepare_staging, validate_metadata

    request = MergeRequest.of(str(demo("fsdp2-w2").role_dir), str(tmp_path / "model"), dtype="keep",
                              max_shard_size="100KB")
    discovered = discover_shards.fn(request)
    validated = validate_metadata.fn(request, discovered)
    planned = plan_groups.fn(request, discovered, validated)
    staged = prepare_staging.fn(request, discovered, validated, planned)
    return request, discovered, validated, planned, staged


def test_each_step_passes_json_on(steps):
    request, discovered, validated, planned, _ = steps
    assert json.loads(json.dumps(discovered)) == discovered and json.loads(json.dumps(validated)) == validated
    assert discovered["world_size"] == 2 and len(discovered["fingerprints"]) == 2  # two rank files
    assert validated["config"]["model_type"] == "qwen2" and validated["tied"] == {}  # no tied tensors dropped


def test_the_plan_is_made_from_what_validation_returned(demo, steps):
    """validate_metadata's result is the plan's input (the old flow dropped it and re-read config.json)."""
    from ckptflow.tasks import plan_groups

    request, discovered, validated, _, _ = steps
    saved = json.loads((demo("fsdp2-w2").role_dir / "huggingface" / "config.json").read_text())
    assert "float16" not in (saved.get("dtype"), saved.get("torch_dtype"))
    auto = MergeRequest.of(request.what.checkpoint, dtype="auto")
    said = {**validated, "config": {**validated["config"], "dtype": "float16", "torch_dtype": "float16"}}
    assert plan_groups.fn(auto, discovered, said).plan.dtype == "float16"


RERUN = """
import json, pickle, sys
from prefect.logging import disable_run_logger
from mergecore import MergeRequest
from ckptflow.tasks import merge_unit

inputs = pickle.loads(open(sys.argv[1], "rb").read())
request = MergeRequest.from_dict(json.loads(inputs["request"]))
try:
  with disable_run_logger():  # the task's body alone, outside any flow run
    for group in inputs["planned"].plan.groups:
        merge_unit.fn(request, json.loads(inputs["discovered"]), inputs["validated"], inputs["planned"], group,
                      inputs["staged"])
except Exception as error:
    print("refused:", error)
    sys.exit(2)
"""


def rerun_groups_in_fresh_process(steps, tmp_path) -> subprocess.CompletedProcess:
    request, discovered, validated, planned, staged = steps
    inputs = tmp_path / "inputs.pickle"
    inputs.write_bytes(pickle.dumps({"request": json.dumps(request.to_dict()), "discovered": json.dumps(discovered),
                                     "validated": validated, "planned": planned, "staged": staged}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / ".shim"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", RERUN, str(inputs)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_merge_unit_reruns_in_a_fresh_process_from_its_inputs_alone(demo, steps, tmp_path):
    """No per-process cache is needed: a new process given only the task's inputs writes the trained weights."""
    _, _, _, planned, staged = steps
    done = rerun_groups_in_fresh_process(steps, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    written = {}
    for file in planned.plan.files:
        written.update(load_file(str(Path(staged.staging) / file)))
    reference = {}
    for file in demo("fsdp2-w2").reference_dir.glob("*.safetensors"):
        reference.update(load_file(str(file)))
    assert written.keys() == reference.keys()
    for name, values in reference.items():
        assert np.array_equal(written[name], values), name


def test_a_rerun_refuses_files_changed_since_discovery(demo_copy, tmp_path):
    from ckptflow.tasks import discover_shards, plan_groups, prepare_staging, validate_metadata

    ckpt = demo_copy("fsdp2-w2")
    request = MergeRequest.of(str(ckpt.role_dir), str(tmp_path / "model"), dtype="keep")
    discovered = discover_shards.fn(request)
    validated = validate_metadata.fn(request, discovered)
    planned = plan_groups.fn(request, discovered, validated)
    staged = prepare_staging.fn(request, discovered, validated, planned)
    rank = next(ckpt.role_dir.glob("model_world_size_2_rank_1.pt"))
    os.utime(rank, (rank.stat().st_atime, rank.stat().st_mtime + 60))  # as a re-upload would
    done = rerun_groups_in_fresh_process((request, discovered, validated, planned, staged), tmp_path)
    assert done.returncode == 2 and "changed since the promotion discovered them" in done.stdout, done.stdout + done.stderr


# ---- one open of the checkpoint per process per promotion

def test_a_promotion_opens_each_rank_file_once(prefect_server, demo, tmp_path, monkeypatch):
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest

    role = demo("fsdp2-w2").role_dir
    opened = collections.Counter()
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name.startswith("model_world_size_"):
            opened[Path(file).name] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    result = promote_checkpoint(PromotionRequest.of(str(role), str(tmp_path / "model"), dtype="keep"))
    assert all(check["ok"] for check in result["checks"])
    assert opened == {"model_world_size_2_rank_0.pt": 1, "model_world_size_2_rank_1.pt": 1}, opened


# ---- the public API, symmetric and with examples that run

@pytest.mark.parametrize("name", ["merge", "verify", "inspect", "push"])
def test_public_api_examples_run_unskipped(name):
    function = getattr(mergecore, name)
    assert callable(function) and function.__module__ == "mergecore.api"
    found = doctest.DocTestFinder().find(function, name, globs=vars(sys.modules[function.__module__]).copy())[0]
    assert found.examples and not any(e.options.get(doctest.SKIP) for e in found.examples)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(found)
    assert runner.summarize(verbose=False).failed == 0


def test_the_inspect_function_survives_importing_the_module_behind_it():
    import mergecore
    import mergecore.describe  # noqa: F401  (the descriptions behind `inspect`: a module of another name)

    assert callable(mergecore.inspect) and mergecore.inspect.__module__ == "mergecore.api"
