"""Publishing a verified folder to the Hugging Face Hub with `huggingface_hub` (never raw HTTP).

Idempotent: files the revision already holds are skipped by the client, so pushing an unchanged
folder makes no commit. After the push the remote revision is checked against the local folder.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .errors import CheckpointError, VerificationError
from .retries import Retries


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
    The client retries throttling (429) and server errors (5xx) on most calls; the calls it does not
    retry (create repo/branch/tag, the commit) are retried here, `CKPTFLOW_HUB_RETRIES` times (default 3),
    honouring Retry-After. The commit is all or nothing, so a push that fails leaves the branch as it was
    and the next push completes it (uploaded LFS objects are not sent again). Error text never holds the token.

    >>> push_folder("out/model", "org/model", revision="step-100")  # doctest: +SKIP
    {'repo_id': 'org/model', 'revision': 'step-100', 'commit': '3f2a...', 'new_commit': True, ...}
    """
    from .targets import LocalTarget, open_target

    target = open_target(folder)
    if not isinstance(target, LocalTarget):  # a model on object storage is pushed from a local copy of its files
        with target.local_copy() as local:
            return push_folder(local, repo_id, revision=revision, private=private, token=token, tag=tag,
                               commit_message=commit_message)
    import httpx2
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    folder = Path(folder)
    branch = revision or "main"
    api = HfApi(token=token)
    secret = token or get_token()
    policy = Retries.from_env("CKPTFLOW_HUB", 3, 2.0)
    retried = functools.partial(policy.call, wait_after=_hub_wait(policy))
    try:
        repo_url = retried(lambda: api.create_repo(repo_id, private=private, exist_ok=True))
        before = retried(lambda: _head(api, repo_id, branch))
        if before is None:
            retried(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True))
        # delete_patterns: the revision mirrors the folder (stale shards of an earlier push go).
        commit = retried(lambda: api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=branch, delete_patterns="*",
            commit_message=commit_message or f"ckptflow: upload {folder.name}"))
        if tag:
            retried(lambda: api.create_tag(repo_id, tag=tag, revision=branch, exist_ok=True))
        check = retried(lambda: api.verify_repo_checksums(repo_id, revision=commit.oid, local_dir=folder))
    except RepositoryNotFoundError as error:
        raise CheckpointError(scrub(f"Hub repo {repo_id}: not found or not yours ({_first_line(error)}); check the "
                                    "name and HF_TOKEN", secret)) from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        hint = "set HF_TOKEN to a token with write access" if status in (401, 403) else "try again later"
        raise CheckpointError(scrub(f"Hub push of {folder} to {repo_id}: HTTP {status} ({_first_line(error)}); "
                                    f"{hint} (the branch is unchanged)", secret)) from None
    except httpx2.TransportError as error:
        raise CheckpointError(scrub(f"Hub push of {folder} to {repo_id}: connection failed ({_first_line(error)}); "
                                    "try again later (the branch is unchanged)", secret)) from None
    if check.mismatches or set(check.missing_paths) - {".gitattributes"} or check.extra_paths:
        raise VerificationError(
            f"Hub revision {commit.oid} of {repo_id} differs from {folder} ({len(check.mismatches)} mismatched, "
            f"{len(check.extra_paths)} not uploaded); push again"
        )
    return {"repo_id": repo_id, "revision": branch, "commit": commit.oid, "new_commit": commit.oid != before,
            "url": f"{str(repo_url).rstrip('/')}/tree/{branch}", "tag": tag, "files_checked": check.checked_count}


# Requests huggingface_hub sends once (no retry of its own): create repo, branch, tag, the commit, repo info.
_UNRETRIED_BY_CLIENT = re.compile(
    r"/api/repos/create$|/(?:branch|tag|commit)/[^/]+$|^/api/(?:models|datasets|spaces)/[^/]+/[^/]+(?:/revision/[^/]+)?$")
_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
_MAX_RETRY_AFTER_S = 60.0


def _hub_wait(retries: Retries):
    """How long to wait before retrying a failed Hub call (None: do not): after a 429/5xx or a dropped
    connection on a request the client sent only once."""

    def wait(error: Exception, attempt: int) -> float | None:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(error, HfHubHTTPError) and error.response is not None:
            response = error.response
            if response.status_code not in _RETRYABLE_STATUS or not _UNRETRIED_BY_CLIENT.search(response.request.url.path):
                return None
            after = response.headers.get("Retry-After", "").strip()
            if after.isdigit():
                return min(float(after), _MAX_RETRY_AFTER_S)
        elif not (isinstance(error, httpx2.TransportError) and _UNRETRIED_BY_CLIENT.search(error.request.url.path)):
            return None
        return retries.delay(attempt)

    return wait


def scrub(text: str, token: str | None) -> str:
    """`text` without the token, bearer credentials or signed-URL secrets.

    >>> scrub("401 for Bearer hf_abc at /u?token=xyz&a=1", "hf_abc")
    '401 for Bearer *** at /u?token=***&a=1'
    """
    if token:
        text = text.replace(token, "***")
    text = re.sub(r"(?i)(bearer\s+)[^\s,;)'\"]+", r"\1***", text)
    return re.sub(r"(?i)([?&](?:token|signature|x-amz-signature|x-amz-credential)=)[^&\s)'\"]+", r"\1***", text)


def _head(api, repo_id: str, branch: str) -> str | None:
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return api.repo_info(repo_id, revision=branch).sha
    except RevisionNotFoundError:
        return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
