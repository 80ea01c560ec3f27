"""The GPU path: `bench/gpu_check.py` (run on CPU here, on CUDA where torch sees a GPU) and the logits check's device."""

from __future__ import annotations

from helpers import REPO
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = REPO / "bench" / "gpu_check.py"
HAS_CUDA = torch.cuda.is_available()


def test_gpu_check_merges_and_checks_logits_in_bf16_and_fp32(demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    run = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(ckpt.role_dir), "--reference",
                          str(ckpt.reference_dir), "--work", str(tmp_path), "--seq-len", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    device = "cuda" if HAS_CUDA else "cpu"
    assert lines[0].startswith(f"gpu_check: device {device} (")
    if not HAS_CUDA:
        assert "the same check runs on the CPU" in lines[0]
    results = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines if line.startswith("result ")]
    assert [r["dtype"] for r in results] == ["bf16", "fp32"]
    for r in results:
        # The merged weights are the reference's cast to the dtype: the two models' logits are the same numbers.
        assert (r["device"], r["ok"], float(r["max_abs_diff"])) == (device, "True", 0.0)
        assert float(r["merge_s"]) > 0 and float(r["logits_s"]) > 0
    assert lines[-1] == "gpu_check: ok"
    # The merges it checked are real folders in the dtype asked for.
    assert (tmp_path / "merged-fp32" / "ckptflow_manifest.json").is_file()
    assert '"dtype": "bfloat16"' in (tmp_path / "merged-bf16" / "ckptflow_manifest.json").read_text()


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: --require-cuda is satisfied")
def test_gpu_check_require_cuda_refuses_a_cpu_machine_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--require-cuda", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "sees no CUDA GPU" in run.stderr
    assert not list(tmp_path.iterdir())  # refused before writing anything


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: cuda is a valid choice here")
def test_logits_device_from_the_environment_is_obeyed_and_checked(demo, tmp_path, cli, monkeypatch):
    """CKPTFLOW_LOGITS_DEVICE tells the logits check where to run (a GPU pool can force cpu); one it cannot use
    is refused in one line naming the variable, not silently replaced by the CPU."""
    ckpt = demo("fsdp2-w2")
    out = tmp_path / "merged"
    assert cli("merge", "--local-dir", ckpt.role_dir, "--target-dir", out).exit_code == 0
    monkeypatch.setenv("CKPTFLOW_LOGITS_DEVICE", "cuda")
    result = cli("verify", out, "--reference", ckpt.reference_dir, "--logits")
    assert result.exit_code == 2, result.output
    assert "CKPTFLOW_LOGITS_DEVICE is 'cuda'" in result.stderr and "sees no CUDA GPU" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("CKPTFLOW_LOGITS_DEVICE", "cpu")
    result = cli("verify", out, "--reference", ckpt.reference_dir, "--logits")
    assert result.exit_code == 0, result.output
