"""Bad values are refused where they enter, before any work: one line, exit 2, nothing merged or written.

A Hub repo id the Hub would refuse, an unusable `CKPTFLOW_LOCK_TIMEOUT`, event fields of the wrong type or form,
a watch state of the wrong shape. Each used to cost a whole merge (then a traceback), wait for ever, or crash.
"""

from __future__ import annotations

import os

import pytest

from ckptflow.flows.events import checkpoint_event
from ckptflow.flows.service import event_place, promote_uploaded
from mergecore import CheckpointError

BAD_REPO_IDS = ["alice/m..x", "alice/../bob", "alice/a/b", "alice/m x", "alice/", "-alice/m", "alice/" + "m" * 200]


def one_line_exit_2(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("repo", BAD_REPO_IDS)
def test_merge_refuses_a_repo_id_the_hub_would_refuse_before_merging(demo, cli, tmp_path, repo):
    # was: the whole merge ran and published, then huggingface_hub's HFValidationError as a traceback (exit 1)
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out",
                 "--hf_upload_path", repo)
    assert "--hf_upload_path" in one_line_exit_2(result) and "not a Hub repo id" in result.stderr
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("repo", BAD_REPO_IDS[:3])
def test_promote_refuses_a_repo_id_before_a_flow_run_starts(prefect_server, cli, demo, tmp_path, repo):
    from prefect.client.orchestration import get_client

    def flow_runs() -> int:
        with get_client(sync_client=True) as client:
            return len(client.read_flow_runs(limit=200))

    before = flow_runs()
    result = cli("promote", demo("fsdp2-w2").role_dir, "--target", tmp_path / "out", "--hub-repo", repo)
    assert "--hub-repo" in one_line_exit_2(result)
    assert flow_runs() == before and not (tmp_path / "out").exists()


def test_an_event_naming_a_repo_the_hub_would_refuse_is_refused_at_the_boundary(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hub repo id"):
        event_place("s3://ckpts/run1/global_step_7/actor", str(tmp_path), "acme", hub_repo="acme/m..x")


@pytest.mark.parametrize("value", ["nan", "-5", "inf", "ten"])
def test_an_unusable_lock_timeout_is_refused_before_merging(demo, cli, tmp_path, monkeypatch, value):
    # was: nan waited for ever behind another writer, -5 failed at once saying the lock was "held for -5 s", and
    # either published when nobody else held the lock
    monkeypatch.setenv("CKPTFLOW_LOCK_TIMEOUT", value)
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out")
    assert f"CKPTFLOW_LOCK_TIMEOUT={value!r}" in one_line_exit_2(result)
    assert os.listdir(tmp_path) == []


# ---- event fields: by type and form at the boundary, before anything reads them

CKPT = "s3://ckpts/run1/global_step_7/actor"


@pytest.mark.parametrize("fields, says", [
    ({"checkpoint": "/ckpts/run1\x00/global_step_7/actor"}, "NUL byte"),
    ({"target": "run1/\x00x"}, "NUL byte"),
    ({"step": -1}, "event step -1"),
    ({"step": True}, "event step True"),
    ({"step": "7/../../x"}, "event step '7/../../x'"),
    ({"step": 7.5}, "event step 7.5"),
    ({"target": "run1/.step-7.ckptflow-partial"}, "keeps for itself"),
    ({"target": "run1/.step-7.ckptflow-results"}, "keeps for itself"),
    ({"checkpoint": 7}, "give a folder or URL"),
    ({"checkpoint": ["s3://a"]}, "give a folder or URL"),
    ({"checkpoint": None}, "give a folder or URL"),
    ({"target": 7}, "give a folder or URL"),
    ({"run": ["run1"]}, "event run"),
    ({"hub_repo": 7}, "event hub_repo"),
    ({"revision": {"x": 1}}, "event revision"),
])
def test_event_fields_of_the_wrong_type_or_form_are_one_line(tmp_path, fields, says):
    asked = {"checkpoint": CKPT, **fields}
    with pytest.raises(CheckpointError, match=says.replace(".", r"\.").replace("[", r"\[")) as refused:
        event_place(asked.pop("checkpoint"), str(tmp_path), "acme", **asked)
    assert "\n" not in str(refused.value)
    assert os.listdir(tmp_path) == []


def test_the_sender_refuses_what_the_receiver_would():
    with pytest.raises(CheckpointError, match="event step -1"):
        checkpoint_event(CKPT, step=-1)
    assert checkpoint_event(CKPT, step="12")["payload"]["step"] == 12  # as a template renders a number


def test_a_checkpoint_through_a_link_loop_or_too_long_is_refused_at_the_boundary(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    boundary = {"target_root": str(tmp_path / "models"), "hub_org": "acme", "checkpoint_root": str(tmp_path)}
    with pytest.raises(CheckpointError, match="cannot be resolved"):
        promote_uploaded.fn(str(tmp_path / "loop" / "global_step_7" / "actor"), **boundary)
    with pytest.raises(CheckpointError, match="longer than the system allows"):
        promote_uploaded.fn(str(tmp_path / ("x" * 300) / "global_step_7" / "actor"), **boundary)
    with pytest.raises(CheckpointError, match="longer than the system allows"):
        promote_uploaded.fn(str(tmp_path / "/".join(["abcdefgh"] * 600)), **boundary)
    assert sorted(os.listdir(tmp_path)) == ["loop"]


# ---- the watch state


@pytest.mark.parametrize("text", ["[]", '{"announced": []}', '{"sizes": {"x": 3}}', '"state"'])
def test_a_watch_state_of_the_wrong_shape_is_one_line(cli, tmp_path, text):
    (tmp_path / "up").mkdir()
    state = tmp_path / "state.json"
    state.write_text(text)
    result = cli("watch", tmp_path / "up", "--once", "--state", state)
    assert str(state) in one_line_exit_2(result) and "not a watch state" in result.stderr
    assert state.read_text() == text  # left for the user to look at
