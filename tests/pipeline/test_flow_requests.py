"""The flows take one typed request (flows/requests.py): the Prefect UI's form shows its parts, a stored run's JSON
gives the same request back, and every bad value is the library's own one line from whichever edge it enters by
(the CLI, a Python call, a deployment's or a rerun's JSON). No flow run here but the CLI's two refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ckptflow.flows.latest import promote_latest
from ckptflow.flows.promote import promote_checkpoint
from ckptflow.flows.requests import PromotionRequest, PromotionSettings
from ckptflow.flows.service import promote_uploaded
from mergecore import CheckpointError, LoraSettings, MergeRequest, MergeSettings, MergeSource, MergeTarget

CKPT, TARGET = "ckpts/run1/global_step_7/actor", "out/model"


def form(flow) -> dict:
    """The flow's parameter schema as Prefect sends it to the UI (the form) and to the server (its enforcement)."""
    return flow.parameters.model_dump(exclude_unset=True)


def fields_of(schema: dict, name: str) -> set[str]:
    return set(schema["definitions"][name]["properties"])


def test_the_ui_form_shows_the_request_part_by_part():
    schema = form(promote_checkpoint)
    assert set(schema["properties"]) == {"request"} and schema["required"] == ["request"]
    request = schema["definitions"]["PromotionRequest"]
    assert set(request["properties"]) == {"what", "how", "where", "reference", "trust_remote_code", "engine",
                                           "engine_python", "hub", "runner"}
    assert set(request["required"]) == {"what", "where"}
    # the library's parts, field for field (only the settings a promotion takes: it always verifies)
    assert fields_of(schema, "Source") == {f.name for f in dataclasses.fields(MergeSource)}
    assert fields_of(schema, "Lora") == {f.name for f in dataclasses.fields(LoraSettings)}
    assert fields_of(schema, "Target") == {f.name for f in dataclasses.fields(MergeTarget)}
    assert fields_of(schema, "Settings") == {"dtype", "max_shard_size", "on_nonfinite", "quantize", "quantize_ignore"}
    assert fields_of(schema, "Settings") <= {f.name for f in dataclasses.fields(MergeSettings)}
    assert fields_of(schema, "HubPush") == {"repo", "revision", "private", "tag", "token_secret"}
    assert fields_of(schema, "Runner") == {"task_runner", "dask_address", "dask_workers"}
    for part in ("Source", "Lora", "Settings", "Target", "HubPush", "Runner", "PromotionRequest"):
        assert schema["definitions"][part]["additionalProperties"] is False, part  # a misspelt field is refused
    assert schema["definitions"]["Settings"]["properties"]["on_nonfinite"]["default"] == "fail"  # promote's default


def test_event_and_schedule_flows_keep_their_own_fields_flat_and_take_one_settings_object():
    uploaded, latest = form(promote_uploaded), form(promote_latest)
    event = {"checkpoint", "step", "run", "target", "hub_repo", "revision", "event_id"}  # what the trigger fills
    boundary = {"target_root", "hub_org", "checkpoint_root", "revision_pattern"}  # what `ckptflow deploy` sets
    assert set(uploaded["properties"]) == event | boundary | {"settings"}
    assert set(latest["properties"]) == {"run_roots", "target_root", "hub_org", "keep_last_n", "settings"}
    for schema in (uploaded, latest):
        assert fields_of(schema, "PromotionSettings") == {"role", "backend", "hf_dir", "how", "private",
                                                             "hub_token_secret", "engine", "engine_python"}
        assert fields_of(schema, "Settings") == fields_of(form(promote_checkpoint), "Settings")


def test_a_stored_run_gives_the_same_request_and_the_tasks_the_same_merge_request():
    """What a deployment, the UI's form and its Retry send is the request's JSON: it comes back equal, and its
    MergeRequest is the one the library's own builder makes of the same options (so cache keys do not move)."""
    request = PromotionRequest.of(CKPT, TARGET, dtype="bf16", max_shard_size="2GB", role="critic", backend="fsdp",
                                  lora={"alpha": 16.0, "r": 8}, quantize="w4a16", quantize_ignore=["*.layers.0.*"],
                                  overwrite=True, reference="ref/model", hub={"repo": "acme/run1", "revision": "step-7"})
    stored = json.loads(json.dumps(promote_checkpoint.serialize_parameters({"request": request})))
    assert stored["request"]["hub"] == {"repo": "acme/run1", "revision": "step-7", "private": True, "tag": None,
                                        "token_secret": None}
    again = promote_checkpoint.validate_parameters(stored)["request"]
    assert again == request
    assert again.merge_request() == MergeRequest.of(CKPT, TARGET, dtype="bf16", max_shard_size="2GB", role="critic",
                                                    backend="fsdp", lora={"alpha": 16.0, "r": 8}, quantize="w4a16",
                                                    quantize_ignore=("*.layers.0.*",), overwrite=True,
                                                    on_nonfinite="fail")
    assert PromotionRequest.of(CKPT, TARGET).merge_request() == MergeRequest.of(CKPT, TARGET, on_nonfinite="fail")


def library_refusal(build) -> str:
    """The one line the library itself gives for a bad value (the expected message of every edge)."""
    with pytest.raises(CheckpointError) as refused:
        build()
    return str(refused.value)


def _engine(**options):
    from ckptflow.flows.runners import check_runner_options

    check_runner_options(options.get("task_runner", "threads"), options.get("dask_address"), options.get("dask_workers"))


def _hub(repo):
    from mergecore.hub import check_repo_id

    check_repo_id(repo)


BAD = {  # a flat option of PromotionRequest.of -> the library call that refuses the same value
    "dtype": ({"dtype": "bf17"}, lambda: MergeSettings(dtype="bf17")),
    "shard size": ({"max_shard_size": "0"}, lambda: MergeSettings(max_shard_size="0")),
    "nonfinite policy": ({"on_nonfinite": "maybe"}, lambda: MergeSettings(on_nonfinite="maybe")),
    "quantize scheme": ({"quantize": "int3"}, lambda: MergeSettings(quantize="int3")),
    "ignore without quantize": ({"quantize_ignore": ["x"]}, lambda: MergeSettings(quantize_ignore=("x",))),
    "lora output": ({"lora": {"output": "fused"}}, lambda: LoraSettings(output="fused")),
    "lora rank": ({"lora": {"r": 0}}, lambda: LoraSettings(r=0)),
    "lora with mapping": ({"lora": {"alpha": 2.0}, "custom_mapping": "map.json"},
                          lambda: MergeSource(CKPT, custom_mapping="map.json", lora=LoraSettings(alpha=2.0))),
    "hf dir with NUL": ({"hf_dir": "hf\x00dir"}, lambda: MergeSource(CKPT, hf_dir="hf\x00dir")),
    "hub repo": ({"hub": {"repo": "alice/../bob"}}, lambda: _hub("alice/../bob")),
    "task runner": ({"task_runner": "ray"}, lambda: _engine(task_runner="ray")),
    "dask options": ({"task_runner": "dask", "dask_address": "tcp://x:1", "dask_workers": 2},
                     lambda: _engine(task_runner="dask", dask_address="tcp://x:1", dask_workers=2)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_value_is_the_library_s_one_line_wherever_it_enters(case):
    options, library = BAD[case]
    says = library_refusal(library)
    assert "\n" not in says
    with pytest.raises(CheckpointError) as at_the_cli:  # the CLI's builder, and any Python caller
        PromotionRequest.of(CKPT, TARGET, **options)
    assert str(at_the_cli.value) == says
    with pytest.raises(CheckpointError) as in_a_run:  # the flow's parameter check: the run fails with that line
        promote_checkpoint.validate_parameters({"request": as_sent(options)})
    assert str(in_a_run.value) == says


def as_sent(options: dict) -> dict:
    """`PromotionRequest.of`'s flat options as a deployment's or a stored run's JSON holds them: each in the part the
    UI's form shows it in."""
    schema = form(promote_checkpoint)
    owner = {field: part for part, name in (("what", "Source"), ("how", "Settings"), ("runner", "Runner"))
             for field in fields_of(schema, name)}
    sent = {"what": {"checkpoint": CKPT}, "where": {"target": TARGET}}
    for key, value in options.items():
        if key in owner:
            sent.setdefault(owner[key], {})[key] = value
        else:
            sent[key] = value
    return sent


def test_the_targets_and_checkpoints_the_library_refuses_are_refused_too():
    for target in ("", "out/model\x00"):
        with pytest.raises(CheckpointError) as refused:
            PromotionRequest.of(CKPT, target)
        assert str(refused.value) == library_refusal(lambda: MergeTarget(target))
    with pytest.raises(CheckpointError) as refused:
        PromotionRequest.of("", TARGET)
    assert str(refused.value) == library_refusal(lambda: MergeSource(""))


def test_a_misspelt_option_is_refused_not_dropped():
    with pytest.raises(TypeError, match="unknown option 'dtyp'"):
        PromotionRequest.of(CKPT, TARGET, dtyp="bf16")
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="Extra inputs are not permitted"):
        promote_checkpoint.validate_parameters({"request": {"what": {"checkpoint": CKPT, "rol": "critic"},
                                                            "where": {"target": TARGET}}})


def test_the_settings_of_events_and_schedules_make_the_same_request():
    settings = PromotionSettings(role="critic", how={"dtype": "fp32", "quantize": "w8a16"}, private=False,
                                 hub_token_secret="hub-token")
    pushed = settings.request(CKPT, TARGET, "acme/run1", "step-7")
    assert pushed.merge_request() == MergeRequest.of(CKPT, TARGET, role="critic", dtype="fp32", quantize="w8a16",
                                                     on_nonfinite="fail")
    assert (pushed.hub.repo, pushed.hub.revision, pushed.hub.private, pushed.hub.token_secret) == \
        ("acme/run1", "step-7", False, "hub-token")
    assert settings.request(CKPT, TARGET, None, None).hub is None  # no Hub organisation: no push
    with pytest.raises(CheckpointError) as refused:  # a deployment's bad settings fail each run at its start
        promote_uploaded.validate_parameters({"checkpoint": CKPT, "settings": {"how": {"dtype": "bf17"}}})
    assert str(refused.value) == library_refusal(lambda: MergeSettings(dtype="bf17"))


def flow_runs() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return len(client.read_flow_runs(limit=200))


@pytest.mark.parametrize("command", ["promote", "promote-latest"])
def test_the_cli_refuses_a_bad_value_before_a_flow_run_starts(prefect_server, cli, demo, tmp_path, command):
    before = flow_runs()
    where = ["--target", tmp_path / "out"] if command == "promote" else ["--target-root", tmp_path / "out"]
    result = cli(command, demo("fsdp2-w2").run_root, *where, "--dtype", "bf17")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {library_refusal(lambda: MergeSettings(dtype='bf17'))}"]
    assert flow_runs() == before and not (tmp_path / "out").exists()


def test_the_module_s_examples_run():
    import doctest

    import ckptflow.flows.requests

    result = doctest.testmod(ckptflow.flows.requests, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0
