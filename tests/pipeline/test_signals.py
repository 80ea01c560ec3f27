"""SIGTERM (Kubernetes, Slurm, `timeout`) ends a command like Ctrl-C, and the temporary Prefect server behaves.

Real processes: `python -m ckptflow.flows.cli ...` started with Popen, signalled, and the machine searched for what they
left behind (the staging folder, the embedded server's uvicorn process).
"""

from __future__ import annotations

from helpers import REPO
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

STARTUP_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def cli_process(args: list, env: dict, log_dir: Path) -> subprocess.Popen:
    """`ckptflow ARGS` in its own process; output to files (a leftover child holding a pipe cannot hang us)."""
    return subprocess.Popen([sys.executable, "-m", "ckptflow.flows.cli", *map(str, args)], cwd=REPO, env=env,
                            stdout=open(log_dir / "stdout.log", "wb"), stderr=open(log_dir / "stderr.log", "wb"),
                            preexec_fn=as_in_a_terminal)


def as_in_a_terminal() -> None:
    """SIGINT handled as a foreground command's: a suite started in the background (`pytest &`) inherits SIGINT
    ignored, and a child keeps an ignored signal ignored (as it should: `cmd &` is not interrupted by Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(condition, process: subprocess.Popen, timeout_s: float, what: str, poll_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the command ended (rc {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(poll_s)


def only_line(stderr: str) -> str:
    """The one line a stopped command printed (a vanished progress bar may leave a blank line)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr[-3000:]
    return lines[0]


def prefect_env(home: Path, **extra) -> dict:
    """A fresh PREFECT_HOME and no PREFECT_API_URL: Prefect starts its temporary server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO),
                  **extra}


def processes_of(home: Path) -> list[str]:
    """Live processes run with this PREFECT_HOME or naming it on their command line."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "environ", "status"]):
        info = process.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        named = str(home) in " ".join(info["cmdline"] or []) or (info["environ"] or {}).get("PREFECT_HOME") == str(home)
        if named:
            found.append(f"{info['pid']}: {' '.join(info['cmdline'] or [])}")
    return found


def alive(processes: list[psutil.Process]) -> list[str]:
    return [f"{p.pid}: {' '.join(p.cmdline())}" for p in processes
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sent, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_merge_removes_staging_and_exits_128_plus_its_number_with_one_line(demo, tmp_path, sent, code):
    source = demo("fsdp2-w2-vocab8k").role_dir  # 8192-row embedding and head: with 1-row blocks, ~2 s of merging
    target = tmp_path / "model"
    staging = tmp_path / ".model.ckptflow-partial"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTFLOW_CHUNK_BYTES": "1"}
    merge = cli_process(["merge", "--local_dir", source, "--target_dir", target], env, tmp_path)
    try:
        wait_until(staging.exists, merge, 120, "staging folder")
        merge.send_signal(sent)
        merge.wait(60)
    finally:
        merge.kill()
    line = only_line((tmp_path / "stderr.log").read_text())
    assert merge.returncode == code, (merge.returncode, line)
    assert f"interrupted by {sent.name}" in line
    assert not staging.exists() and not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stderr.log", "stdout.log"]


def test_sigterm_during_a_promotion_stops_the_temporary_server(demo, tmp_path):
    home = tmp_path / "prefect-home"
    source = demo("fsdp2-w2-vocab8k").role_dir
    stderr = tmp_path / "stderr.log"
    promote = cli_process(["promote", source, "--target", tmp_path / "model"],
                          prefect_env(home, CKPTFLOW_CHUNK_BYTES="1"), tmp_path)
    try:
        wait_until(lambda: "Beginning subflow run" in stderr.read_text(), promote, 240, "flow run", poll_s=0.05)
        children = psutil.Process(promote.pid).children(recursive=True)
        assert any("uvicorn" in " ".join(child.cmdline()) for child in children), "no temporary server was started"
        promote.send_signal(signal.SIGTERM)
        promote.wait(90)
    finally:
        promote.kill()
    output = stderr.read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert promote.returncode == 143 and len(errors) == 1 and "SIGTERM" in errors[0], output[-3000:]
    assert output.strip().splitlines()[-1] == errors[0] and "Traceback" not in output, output[-3000:]
    assert not (tmp_path / "model").exists()
    time.sleep(0.5)  # a child killed by its parent's last act may still be being reaped
    assert alive(children) == [] and processes_of(home) == []


LATE_TASK = """
import logging, sys, threading, time
import typer
from prefect import flow
from prefect.events import emit_event
from ckptflow.flows.cli import cli_errors
from ckptflow.flows.signals import raise_on_sigterm

def slow_group():  # a worker thread the signal does not stop, as a group mid-merge is
    time.sleep(4)
    logging.getLogger("prefect.task_runs").warning("group finished after the signal")
    emit_event("ckptflow.test.late", resource={"prefect.resource.id": "late"})

@flow
def promotion():
    threading.Thread(target=slow_group).start()
    time.sleep(30)  # the flow's own work meanwhile: where the signal lands

@cli_errors
def command():
    promotion()

raise_on_sigterm()
try:
    command()
except typer.Exit as done:
    sys.exit(done.exit_code)
"""


def test_a_thread_still_running_after_sigterm_prints_nothing_after_the_one_line(tmp_path):
    """The signal unwinds the main thread; a thread it did not stop (in `promote`, a group mid-merge) logs and emits
    events after the temporary server is gone. Seen in CI after `promote`'s error line: "--- Error logging to API
    ---", "Service 'EventsWorker' failed with 2 pending items". The command's line stays the last."""
    script = tmp_path / "late_task.py"
    script.write_text(LATE_TASK)
    stderr = tmp_path / "stderr.log"
    process = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=prefect_env(tmp_path / "prefect-home"),
                               stdout=open(tmp_path / "stdout.log", "wb"), stderr=open(stderr, "wb"),
                               preexec_fn=as_in_a_terminal)
    try:
        wait_until(lambda: "Beginning flow run" in stderr.read_text(), process, 120, "flow run", poll_s=0.05)
        time.sleep(0.5)  # the other thread is asleep, the flow too
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    finally:
        process.kill()
    output = stderr.read_text()
    assert process.returncode == 143, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("error: interrupted by SIGTERM"), output[-3000:]
    assert "after the signal" not in output and "Error logging to API" not in output, output[-3000:]


def test_a_temporary_server_that_does_not_start_in_time_is_one_line_naming_the_setting(tmp_path):
    home = tmp_path / "prefect-home"
    checkpoint = tmp_path / "checkpoint"  # never read: the server starts with the flow run, before any task
    result = subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "promote", checkpoint, "--target", tmp_path / "model"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=prefect_env(home, **{STARTUP_SETTING: "0"}))  # the user's setting wins over ours
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"within 0 s ({STARTUP_SETTING})" in errors[0] and "PREFECT_API_URL" in errors[0], errors[0]
    assert not (tmp_path / "model").exists() and processes_of(home) == []


def test_the_temporary_server_gets_a_generous_start_up_time_unless_the_user_set_one(monkeypatch):
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as startup_timeout
    from prefect.settings import Settings, temporary_settings

    from ckptflow.flows.settings import in_process_settings

    monkeypatch.delenv(STARTUP_SETTING, raising=False)
    unset = Settings()  # as a user without the setting (env or profile) has it
    assert STARTUP_SETTING not in unset.to_environment_variables(exclude_unset=True)
    with SettingsContext(profile=get_settings_context().profile, settings=unset), in_process_settings():
        assert startup_timeout.value() == 180  # Prefect's own default is 20 s, missed on a busy 2-core machine
    with temporary_settings(updates={startup_timeout: 7}), in_process_settings():
        assert startup_timeout.value() == 7
