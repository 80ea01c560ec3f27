"""NaN/Inf weights: found while converting, refused (`fail`) or published and listed (`warn`).

The checkpoint is written by real FSDP2 with one parameter diverged after the training step
(`DemoSpec.nonfinite_param`); expected counts come from the reference model saved beside it.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from mergecore.numbers.arrays import nonfinite_counts

DIVERGED = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="session")
def diverged(tmp_path_factory):
    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("diverged"), DemoSpec(world_size=2, nonfinite_param=DIVERGED))


def reference_tensor(ckpt, name: str) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(ckpt.reference_dir / "model.safetensors")[name]


def expected_counts(values: np.ndarray) -> dict[str, int]:
    return {"nan": int(np.isnan(values).sum()), "+inf": int(np.isposinf(values).sum()),
            "-inf": int(np.isneginf(values).sum())}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_counts_match_numpy_for_every_float_dtype(dtype):
    values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    values[[5, 70_000, 299_999]] = np.nan
    values[[17, 200_000]] = np.inf
    values[123_456] = -np.inf
    values[1000] = 1e6  # overflows float16 only: found in the converted array, as written
    with np.errstate(over="ignore"):
        converted = values.astype(dtype)
    assert nonfinite_counts(converted) == expected_counts(converted.astype(np.float64))
    assert nonfinite_counts(np.zeros(10, dtype)) is None
    assert nonfinite_counts(np.array([np.finfo(np.float16).max, -np.finfo(np.float16).max], dtype)) is None


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("value", [np.nan, -np.nan, np.inf, -np.inf])
def test_each_kind_alone_is_found_anywhere(dtype, value):
    values = np.linspace(-3e4, 3e4, 700_000).astype(dtype)  # spans several scan chunks; both signs
    values[654_321] = value
    counts = nonfinite_counts(values)
    assert counts is not None and sum(counts.values()) == 1
    assert counts == expected_counts(values.astype(np.float64))


def test_integers_are_not_checked():
    assert nonfinite_counts(np.full(4, -1, np.int16)) is None  # all-ones bits, but not a float


def merge(cli, ckpt, target, *extra):
    return cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target, *extra)


def test_fail_refuses_with_one_line_and_writes_nothing(cli, diverged, tmp_path):
    target = tmp_path / "model"
    result = merge(cli, diverged, target, "--on-nonfinite", "fail")
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    assert DIVERGED in message and str(diverged.role_dir) in message and "--on-nonfinite warn" in message
    assert "1 NaN, 1 +Inf, 1 -Inf" in message
    assert list(tmp_path.iterdir()) == []


def test_warn_publishes_and_lists_them_in_the_manifest(cli, diverged, tmp_path):
    from safetensors.numpy import load_file

    target = tmp_path / "model"
    result = merge(cli, diverged, target)  # warn is merge's default
    assert result.exit_code == 0, result.output
    assert f"warning: {DIVERGED}: 1 NaN, 1 +Inf, 1 -Inf" in result.stderr
    reference = reference_tensor(diverged, DIVERGED)
    manifest = json.loads((target / "ckptflow_manifest.json").read_text())
    listed = {name: counts for receipt in manifest["groups_written"] for name, counts in receipt.get("nonfinite", {}).items()}
    assert listed == {DIVERGED: expected_counts(reference)}
    written = {}
    for file in manifest["files"]:
        if file.endswith(".safetensors"):
            written.update(load_file(target / file))
    assert written[DIVERGED].dtype == ml_dtypes.bfloat16  # config says bfloat16: NaN/Inf survive the cast
    as_float = written[DIVERGED].astype(np.float32)
    for where in (np.isnan, np.isposinf, np.isneginf):  # at the same places as in the model that was saved
        assert np.array_equal(where(as_float), where(reference)), where.__name__


def test_promote_refuses_them_even_from_groups_cached_by_a_warn_run(prefect_server, diverged, tmp_path):
    from ckptflow.flows.requests import PromotionRequest
    from ckptflow.flows.run import run_promotion
    from mergecore import CheckpointError

    target = tmp_path / "model"
    promote = lambda **options: run_promotion(PromotionRequest.of(str(diverged.run_root), str(target), **options))  # noqa: E731
    with pytest.raises(CheckpointError, match=f"{DIVERGED} in .*--on-nonfinite warn"):
        promote()  # fail is promote's default
    assert not target.exists()

    published = promote(on_nonfinite="warn")
    assert published["nonfinite"] == {DIVERGED: expected_counts(reference_tensor(diverged, DIVERGED))}
    assert (target / "ckptflow_manifest.json").exists()

    # every group is a cache hit now (warn/fail is not in the cache key): the receipts still say NaN
    with pytest.raises(CheckpointError, match=DIVERGED):
        promote(on_nonfinite="fail", hub={"repo": "alice/never-pushed"})


def test_policy_docstrings():
    import doctest

    import mergecore.numbers.nonfinite

    result = doctest.testmod(mergecore.numbers.nonfinite)
    assert result.attempted and result.failed == 0


def test_a_remote_target_gets_no_object_of_a_refused_file(diverged, s3_env, tmp_path):
    """A file whose upload stops half-way (here: NaN with on_nonfinite=fail) must not appear truncated at the
    target: fsspec completes an upload on close, so the writer aborts it instead."""
    from mergecore import CheckpointError, merge_checkpoint

    s3_env.mkdir("nonfinite-models")
    with pytest.raises(CheckpointError, match="NaN"):
        merge_checkpoint(str(diverged.role_dir), "s3://nonfinite-models/m", max_shard_size="40KB",
                         on_nonfinite="fail", workers=1)
    s3_env.invalidate_cache()
    left = [p.rsplit("/", 1)[1] for p in s3_env.find("nonfinite-models/m")]
    written = [name for name in left if name.endswith(".safetensors")]
    assert written  # the files before the diverged tensor's were written...
    assert not [name for name in left if "ckptflow_manifest" in name]  # ...but nothing was published
    from safetensors import safe_open

    for name in written:  # and every object there is a whole, valid file
        s3_env.get_file(f"nonfinite-models/m/{name}", str(tmp_path / name))
        with safe_open(tmp_path / name, "np") as weights:
            assert DIVERGED not in weights.keys()
            for key in weights.keys():
                weights.get_tensor(key)
