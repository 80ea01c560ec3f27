"""`ckptflow`: merge, verify, inspect and promote training checkpoints as Hugging Face models.

Flag spellings follow verl's `python -m verl.model_merger` (`--local_dir`, `--target_dir`, ...,
dashed forms too), so verl users switch by changing the program name.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
out = Console()
err = Console(stderr=True)

# Options shared by several commands: (default, names..., help)
BACKEND = typer.Option("auto", "--backend", help="Checkpoint format: auto, fsdp, megatron (legacy mp_rank folders) or megatron_dist.")
LOCAL_DIR = typer.Option(..., "--local_dir", "--local-dir", help="Role folder, global_step_N folder or run root (path or fsspec URL).")
HF_MODEL_PATH = typer.Option(None, "--hf_model_path", "--hf-model-path", help="Folder with config.json when the checkpoint lacks huggingface/.")
ROLE = typer.Option("actor", "--role", help="actor or critic, when --local_dir is a step folder or run root.")
DTYPE = typer.Option("auto", "--dtype", help="auto (config.json's dtype), keep, bf16, fp16 or fp32.")
TIE = typer.Option(False, "--tie-word-embedding", "--tie_word_embedding", help="Assert the model ties embeddings (checked against config.json).")
VALUE_MODEL = typer.Option(False, "--is-value-model", "--is_value_model", help="Assert the checkpoint is a value/critic model (checked against config.json).")
TRUST_REMOTE_CODE = typer.Option(False, "--trust-remote-code", "--trust_remote_code", help="Allow custom model code when loading for the logits check.")
CUSTOM_MAPPING = typer.Option(None, "--custom-mapping", "--custom_mapping", help="JSON/YAML file of extra Megatron -> HF name patterns.")
NONFINITE_HELP = "NaN/Inf in the converted weights: fail (exit 2, nothing published) or warn (publish, list them in the manifest)."
CPU_INIT = typer.Option(False, "--use_cpu_initialization", "--use-cpu-initialization", hidden=True, help="Accepted for verl compatibility; ckptflow always merges on CPU.")


def cli_errors(command):
    """Bad input -> one line on stderr and exit code 2 (3 for failed verification)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        from mergecore import CheckpointError

        try:
            return command(*args, **kwargs)
        except CheckpointError as error:
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(error.exit_code) from None

    return run


def push_merged(folder: Path, manifest: dict, repo_id: str, revision: Optional[str], private: bool,
                tag: Optional[str] = None, checks: Optional[list] = None) -> dict:
    """Write the model card and push a merged folder (endpoint and token from HF_ENDPOINT / HF_TOKEN)."""
    from mergecore.hub import CARD_FILE, model_card, push_folder

    config = json.loads((folder / "config.json").read_text())
    (folder / CARD_FILE).write_text(model_card(manifest, config, checks or manifest.get("verification", [])))
    pushed = push_folder(folder, repo_id, revision=revision, private=private, tag=tag)
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


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("groups"), TimeElapsedColumn(), console=err, transient=False,
    )


def run_merge(local_dir, target_dir, backend, role, hf_model_path, dtype, max_shard_size, tie, is_value_model,
              overwrite, verify, check_replicas, workers, custom_mapping=None, on_nonfinite="warn") -> dict:
    """Prepare, merge with a progress bar, verify and publish; returns the manifest."""
    from mergecore import CheckpointError, merge_checkpoint, prepare
    from mergecore.merge import check_target

    check_target(target_dir, overwrite)
    prepared = prepare(local_dir, role, backend, hf_model_path, dtype, max_shard_size, True if tie else None,
                       check_replicas, custom_mapping)
    check_value_model(is_value_model, prepared.config)
    with _progress() as progress:
        bar = progress.add_task("merging", total=len(prepared.plan.groups))

        def advanced(group: str, receipt: dict) -> None:
            progress.update(bar, advance=1, description=group)

        try:
            manifest = merge_checkpoint(
                local_dir, target_dir, overwrite=overwrite, verify=verify, workers=workers,
                on_group=advanced, prepared=prepared, on_nonfinite=on_nonfinite,
            )
        except CheckpointError:
            progress.live.transient = True  # the error stays the only line
            raise
        progress.update(bar, description="done")
    return manifest


def warn_nonfinite(found: dict) -> None:
    """One warning line per published tensor holding NaN/Inf (always shown: `warn` publishes them)."""
    from mergecore.merge import describe_counts

    for name, counts in found.items():
        err.print(f"[bold yellow]warning:[/] {name}: {describe_counts(counts)} (published; listed in the manifest)",
                  highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def merge(
    local_dir: str = LOCAL_DIR,
    target_dir: str = typer.Option("tmp", "--target_dir", "--target-dir", help="Output folder (published atomically)."),
    backend: str = BACKEND,
    role: str = ROLE,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    dtype: str = DTYPE,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", "--max_shard_size", help="Largest output file, e.g. 5GB."),
    tie_word_embedding: bool = TIE,
    is_value_model: bool = VALUE_MODEL,
    trust_remote_code: bool = TRUST_REMOTE_CODE,
    use_cpu_initialization: bool = CPU_INIT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --target_dir."),
    skip_verify: bool = typer.Option(False, "--skip-verify", help="Publish without the round-trip check (not recommended)."),
    check_replicas: bool = typer.Option(False, "--check-replicas", help="Also check HSDP replicas are identical."),
    workers: int = typer.Option(2, "--workers", help="Threads reading, converting and writing tensors."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
    on_nonfinite: str = typer.Option("warn", "--on-nonfinite", "--on_nonfinite", help=NONFINITE_HELP),
    hf_upload_path: Optional[str] = typer.Option(None, "--hf_upload_path", "--hf-upload-path", help="Also push to this Hub repo (org/name)."),
    private: bool = typer.Option(False, "--private", help="With --hf_upload_path: create the repo private."),
    revision: Optional[str] = typer.Option(None, "--revision", help="With --hf_upload_path: branch to push to (created if missing)."),
):
    """Merge a checkpoint into a verified Hugging Face folder (and optionally push it to the Hub)."""
    if private and not hf_upload_path:
        from mergecore import CheckpointError

        raise CheckpointError("--private only applies with --hf_upload_path ORG/NAME")
    manifest = run_merge(local_dir, target_dir, backend, role, hf_model_path, dtype, max_shard_size,
                         tie_word_embedding, is_value_model, overwrite, not skip_verify, check_replicas, workers,
                         custom_mapping, on_nonfinite)
    from mergecore.merge import nonfinite_found

    warn_nonfinite(nonfinite_found(manifest.get("groups_written", [])))
    checks = ", ".join(f"{c['check']} ok" for c in manifest.get("verification", [])) or "not verified"
    out.print(f"merged {manifest['source']['location']} -> {Path(target_dir).absolute()} "
              f"({len(manifest['files'])} files, dtype {manifest['dtype']}; {checks})", highlight=False, soft_wrap=True)
    if hf_upload_path:
        push_merged(Path(target_dir), manifest, hf_upload_path, revision, private)


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
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance for tensor values (0 = exact)."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance for tensor values (0 = exact)."),
    logits: bool = typer.Option(True, "--logits/--no-logits", help="Also compare logits on fixed token ids."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
):
    """Merge into a temporary folder and compare it with a reference model (verl's `test`)."""
    from mergecore import compare_logits, compare_with_reference

    with tempfile.TemporaryDirectory(prefix="ckptflow-test-") as scratch:
        target = Path(scratch) / "merged"
        run_merge(local_dir, target, backend, role, hf_model_path, dtype, "5GB", tie_word_embedding,
                  is_value_model, False, True, False, 2, custom_mapping)
        results = [compare_with_reference(target, Path(test_hf_dir), atol, rtol)]
        if logits:
            results.append(compare_logits(target, Path(test_hf_dir), trust_remote_code=trust_remote_code))
    print_checks(results)
    out.print(f"test passed: {local_dir} equals {test_hf_dir}", highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def verify(
    folder: Path = typer.Argument(..., help="A folder written by ckptflow merge."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also compare with this Hugging Face folder."),
    logits: bool = typer.Option(False, "--logits", help="With --reference: also compare logits."),
    skip_source: bool = typer.Option(False, "--skip-source", help="Do not re-read the source checkpoint (hashes only)."),
    atol: float = typer.Option(0.0, "--atol"),
    rtol: float = typer.Option(0.0, "--rtol"),
    custom_mapping: Optional[str] = typer.Option(
        None, "--custom-mapping", "--custom_mapping", help="Name patterns for the source (default: the merge's, from its manifest)."),
):
    """Re-check a merged folder: manifest hashes, round-trip against the source shards, optional reference."""
    from mergecore import compare_logits, compare_with_reference, open_checkpoint, verify_manifest, verify_round_trip
    from mergecore.verify import load_manifest

    results = [verify_manifest(folder)]
    if not skip_source:
        manifest = load_manifest(folder)
        source = open_checkpoint(manifest["source"]["location"],
                                 custom_mapping=custom_mapping or manifest["source"].get("custom_mapping"))
        results.append(verify_round_trip(source, folder, manifest.get("aliases", {})))
    if reference:
        results.append(compare_with_reference(folder, reference, atol, rtol))
        if logits:
            results.append(compare_logits(folder, reference))
    print_checks(results)


def print_checks(results: list[dict]) -> None:
    table = Table("check", "result", "details")
    for result in results:
        details = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("check", "ok", "rows"))
        table.add_row(result["check"], "[green]ok[/]" if result["ok"] else "[red]FAILED[/]", details)
    out.print(table)


@app.command()
@cli_errors
def inspect(
    source: str = typer.Argument(..., help="Role folder, global_step_N folder or run root."),
    role: str = ROLE,
    backend: str = BACKEND,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
):
    """Describe a checkpoint: format, world size, mesh, placements, tensors and bytes per group."""
    from mergecore.inspect import describe_checkpoint

    report = describe_checkpoint(source, role=role, backend=backend, custom_mapping=custom_mapping)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    facts = report["checkpoint"]
    out.print(", ".join(f"{k}: {v}" for k, v in facts.items() if k != "files"), highlight=False, soft_wrap=True)
    table = Table("group", "tensors", "bytes", "dtypes", "layouts")
    for group in report["groups"]:
        table.add_row(group["group"], str(group["tensors"]), f"{group['bytes']:,}", ", ".join(group["dtypes"]),
                      "; ".join(group["layouts"]))
    out.print(table)


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
    private: bool = typer.Option(True, "--private/--public", help="Visibility of a newly created Hub repo."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size"),
    role: str = ROLE,
    backend: str = BACKEND,
    hf_model_path: Optional[str] = HF_MODEL_PATH,
    hub_token_secret: Optional[str] = typer.Option(None, "--hub-token-secret", help="Prefect Secret block holding the Hub token (default: HF_TOKEN)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a target holding a different merge."),
    custom_mapping: Optional[str] = CUSTOM_MAPPING,
    on_nonfinite: str = typer.Option("fail", "--on-nonfinite", "--on_nonfinite", help=NONFINITE_HELP),
):
    """Run the Prefect pipeline: merge (cached per group) -> verify -> push to the Hub."""
    from flows.run import run_promotion

    result = run_promotion(checkpoint=checkpoint, target=target, dtype=dtype, reference=reference, hub_repo=hub_repo,
                           revision=revision, private=private, max_shard_size=max_shard_size, role=role,
                           backend=backend, hf_dir=hf_model_path, tag=tag, hub_token_secret=hub_token_secret,
                           overwrite=overwrite, custom_mapping=custom_mapping, on_nonfinite=on_nonfinite)
    warn_nonfinite(result.get("nonfinite", {}))
    print_checks(result["checks"])
    cached = result["cached_groups"]
    out.print(f"verified model: {result['target']}" + (f" ({len(cached)} groups reused from cache)" if cached else ""),
              highlight=False, soft_wrap=True)
    if "hub" in result:
        hub = result["hub"]
        change = "new commit" if hub["new_commit"] else "unchanged, no new commit"
        out.print(f"hub: {hub['url']} ({change} {hub['commit'][:12]})", highlight=False, soft_wrap=True)


@app.command("demo-checkpoint")
@cli_errors
def demo_checkpoint(
    folder: Path = typer.Argument(..., help="Where to write the run (run root)."),
    arch: str = typer.Option("qwen2", "--arch", help="qwen2, llama or critic."),
    mode: str = typer.Option("fsdp2", "--mode", help="fsdp2, hsdp, fsdp1_mesh, fsdp1 or single."),
    world_size: int = typer.Option(2, "--world-size"),
    layers: int = typer.Option(2, "--layers"),
    tie_word_embeddings: bool = typer.Option(False, "--tie-word-embeddings"),
):
    """Train a tiny model for one step with real torch.distributed FSDP and save it as verl does."""
    from mergecore.demo_checkpoint import DemoSpec, write_demo_checkpoint

    spec = DemoSpec(arch=arch, mode=mode, world_size=world_size, num_hidden_layers=layers,
                    tie_word_embeddings=tie_word_embeddings)
    written = write_demo_checkpoint(folder, spec)
    out.print(f"wrote {written.role_dir} (reference model: {written.reference_dir})", highlight=False, soft_wrap=True)


def main() -> None:
    app(prog_name="ckptflow")


if __name__ == "__main__":
    sys.exit(main())
