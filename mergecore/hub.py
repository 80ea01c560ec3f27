"""Publishing a verified folder to the Hugging Face Hub with `huggingface_hub` (never raw HTTP).

Idempotent: files the revision already holds are skipped by the client, so pushing an unchanged
folder makes no commit. After the push the remote revision is checked against the local folder.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError, VerificationError


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
