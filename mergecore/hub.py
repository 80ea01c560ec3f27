"""Publishing a verified folder to the Hugging Face Hub with `huggingface_hub` (never raw HTTP).

Idempotent: files the revision already holds are skipped by the client, so pushing an unchanged
folder makes no commit. After the push the remote revision is checked against the local folder.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError, VerificationError

CARD_FILE = "README.md"


def model_card(manifest: dict, config: dict, checks: list[dict]) -> str:
    """README.md for the Hub: YAML metadata, where the weights came from and how they were proven."""
    source = manifest["source"]
    base_model = config.get("_name_or_path") or ""
    tags = ["ckptflow", source["format"], source.get("role") or "actor"]
    lines = ["---", "library_name: transformers", "tags:"] + [f"- {t}" for t in tags]
    if base_model and "/" in base_model and not base_model.startswith(("/", ".")):
        lines.append(f"base_model: {base_model}")
    lines += ["---", "", f"# {Path(source['location']).name} at step {source.get('step')}", "",
              "Merged from a distributed training checkpoint and verified by "
              f"[ckptflow](https://pypi.org/project/ckptflow/) {manifest['ckptflow_version']}.", "",
              "| | |", "|---|---|",
              f"| source checkpoint | `{source['location']}` |",
              f"| step | {source.get('step')} |",
              f"| format | {source['format']} |",
              f"| world size | {source.get('world_size')} |",
              f"| mesh | {source.get('mesh_shape')} |",
              f"| dtype | {manifest['dtype']} |", "",
              "## Equivalence checks", "", "| check | result | details |", "|---|---|---|"]
    for check in checks:
        if check["check"].startswith("manifest"):  # re-checking local files proves nothing new about the model
            continue
        details = ", ".join(f"{k}={v}" for k, v in check.items() if k not in ("check", "ok", "rows"))
        lines.append(f"| {check['check']} | {'passed' if check['ok'] else 'FAILED'} | {details} |")
    return "\n".join(lines) + "\n"


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = True,
    token: str | None = None,
    tag: str | None = None,
    commit_message: str | None = None,
) -> dict:
    """Create the repo if needed, commit `folder` to `revision` (a branch, made if missing), tag it, verify.

    The endpoint and token come the standard way (HF_ENDPOINT, HF_TOKEN) unless `token` is given.

    >>> push_folder("out/model", "org/model", revision="step-100")  # doctest: +SKIP
    {'repo_id': 'org/model', 'revision': 'step-100', 'commit': '3f2a...', 'new_commit': True, ...}
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    folder = Path(folder)
    branch = revision or "main"
    api = HfApi(token=token)
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
        before = _head(api, repo_id, branch)
        if before is None:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        # delete_patterns: the revision mirrors the folder (stale shards of an earlier push go).
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=branch, delete_patterns="*",
                                   commit_message=commit_message or f"ckptflow: upload {folder.name}")
        if tag:
            api.create_tag(repo_id, tag=tag, revision=branch, exist_ok=True)
        check = api.verify_repo_checksums(repo_id, revision=commit.oid, local_dir=folder)
    except RepositoryNotFoundError as error:
        raise CheckpointError(f"Hub repo {repo_id}: not found or not yours ({_first_line(error)}); check the name and HF_TOKEN") from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        hint = "set HF_TOKEN to a token with write access" if status in (401, 403) else "try again later"
        raise CheckpointError(f"Hub push of {folder} to {repo_id}: HTTP {status} ({_first_line(error)}); {hint}") from None
    if check.mismatches or set(check.missing_paths) - {".gitattributes"} or check.extra_paths:
        raise VerificationError(
            f"Hub revision {commit.oid} of {repo_id} differs from {folder} ({len(check.mismatches)} mismatched, "
            f"{len(check.extra_paths)} not uploaded); push again"
        )
    return {"repo_id": repo_id, "revision": branch, "commit": commit.oid, "new_commit": commit.oid != before,
            "url": f"{str(repo_url).rstrip('/')}/tree/{branch}", "tag": tag, "files_checked": check.checked_count}


def _head(api, repo_id: str, branch: str) -> str | None:
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return api.repo_info(repo_id, revision=branch).sha
    except RevisionNotFoundError:
        return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
