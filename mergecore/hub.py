"""Publishing a verified folder to the Hugging Face Hub with `huggingface_hub` (never raw HTTP).

One push is one commit: the changed files are uploaded first (`preupload_lfs_files`), then a single
`create_commit` adds them and deletes what the revision holds that the folder does not. Never `upload_folder`:
with `hf_xet` installed (the default) it commits in batches and deletes old files in the first batch, so the
branch would hold a partial model while a large one uploads or after an interrupted upload.
Idempotent: an unchanged folder (compared with the revision's tree) makes no commit. After the push the remote
revision is checked against the local folder.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from pathlib import Path

from .errors import CheckpointError, VerificationError
from .storage.retries import Retries


def check_repo_id(repo_id, flag: str = "--hub-repo") -> str:
    """`repo_id` if the Hub would take it as a repo name (huggingface_hub's own rule: `name` or `org/name`, at most
    96 characters of letters, digits, '-', '_', '.', no '--' or '..'); else a one-line CheckpointError naming
    `flag`. Edges call it before any work, so a mistyped repo never costs a merge.

    >>> check_repo_id("alice/run1")
    'alice/run1'
    >>> check_repo_id("alice/../bob")
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: --hub-repo 'alice/../bob': not a Hub repo id (give ORG/NAME: letters, digits, '-', '_' or '.', at most 96 characters, no '--' or '..')
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rule = "give ORG/NAME: letters, digits, '-', '_' or '.', at most 96 characters, no '--' or '..'"
    if not isinstance(repo_id, str):
        raise CheckpointError(f"{flag} {repo_id!r}: not a Hub repo id ({rule})")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(f"{flag} {repo_id!r}: not a Hub repo id ({rule})") from None
    return repo_id


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
    retry (create repo/branch/tag, refs, the commit) are retried here, `CKPTFLOW_HUB_RETRIES` times (default 3),
    honouring Retry-After. The commit is all or nothing, so a push that fails leaves the branch as it was
    and the next push completes it (uploaded LFS objects are not sent again). A `tag` that already names
    another commit is refused, never moved. Error text never holds the token.

    >>> push_folder("out/model", "org/model", revision="step-100")  # doctest: +SKIP
    {'repo_id': 'org/model', 'revision': 'step-100', 'commit': '3f2a...', 'new_commit': True, ...}
    """
    from .targets import open_target

    check_repo_id(repo_id)
    with open_target(folder).local_copy() as local:  # a model on object storage: a local copy of its files
        return _push_local(Path(local), repo_id, revision, private, token, tag, commit_message)


def _push_local(folder: Path, repo_id: str, revision: str | None, private: bool, token: str | None, tag: str | None,
                commit_message: str | None) -> dict:
    import httpx2
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    files = files_to_push(folder)  # before any Hub call: a refused folder creates no repo
    branch = revision or "main"
    api = HfApi(token=token)
    secret = token or get_token()
    policy = Retries.from_env("CKPTFLOW_HUB", 3, 2.0)
    retried = functools.partial(policy.call, wait_after=_hub_wait(policy))
    message = commit_message or f"ckptflow: upload {folder.name}"
    try:
        repo_url = retried(lambda: api.create_repo(repo_id, private=private, exist_ok=True))
        before = retried(lambda: _head(api, repo_id, branch))
        tagged = retried(lambda: _tag_target(api, repo_id, tag)) if tag else None
        if tagged and tagged != before:  # whatever this push publishes, it is not that commit
            raise _tag_elsewhere(repo_id, tag, tagged)
        if before is None:
            retried(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True))
        hashed: dict[Path, str] = {}  # sha256 of local files, computed once however often the publish is retried
        commit, new_commit = retried(lambda: _publish(api, repo_id, branch, folder, files, message, tag, tagged,
                                                      hashed))
        if tag:
            _tag(api, retried, repo_id, tag, commit, tagged)
        check = retried(lambda: api.verify_repo_checksums(repo_id, revision=commit, local_dir=folder))
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
    except json.JSONDecodeError:  # 200 with a web page: a captive portal, a proxy's sign-in, a mistyped endpoint
        raise CheckpointError(scrub(f"HF_ENDPOINT {api.endpoint} answered with something that is not the Hub API "
                                    "(not JSON); check HF_ENDPOINT (nothing was pushed)", secret)) from None
    if check.mismatches or set(check.missing_paths) - {".gitattributes"} or check.extra_paths:
        raise VerificationError(
            f"Hub revision {commit} of {repo_id} differs from {folder} ({len(check.mismatches)} mismatched, "
            f"{len(check.extra_paths)} not uploaded); push again"
        )
    return {"repo_id": repo_id, "revision": branch, "commit": commit, "new_commit": new_commit,
            "url": f"{str(repo_url).rstrip('/')}/tree/{branch}", "tag": tag, "files_checked": check.checked_count}


def files_to_push(folder: Path) -> list[str]:
    """The files of `folder` a push uploads (relative POSIX paths, sorted), refusing in one line what the Hub
    cannot hold as it is: a name that is not UTF-8, a symbolic link, a device, socket or pipe. Skips what
    huggingface_hub never uploads (`.git/`, `.cache/huggingface/`).

    >>> files_to_push(Path("out/model"))  # doctest: +SKIP
    ['README.md', 'ckptflow_manifest.json', 'config.json', 'model.safetensors']
    """
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder; push a merged model folder")
    found = []
    for root, dirs, names in os.walk(folder):
        for name in sorted(dirs) + sorted(names):
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            if not list(filter_repo_objects([relative], ignore_patterns=DEFAULT_IGNORE_PATTERNS)):
                if name in dirs:
                    dirs.remove(name)  # not walked into
                continue
            mode = os.lstat(path).st_mode
            _refuse_unpushable(folder, relative, mode)
            if stat.S_ISREG(mode):
                found.append(relative)
    return sorted(found)


def _refuse_unpushable(folder: Path, relative: str, mode: int) -> None:
    shown = os.fsencode(relative).decode("utf-8", "backslashreplace")  # printable whatever the bytes
    try:
        relative.encode("utf-8")
    except UnicodeEncodeError:  # os.walk decoded undecodable bytes to surrogates
        raise CheckpointError(f"{folder}/{shown}: the file name is not valid UTF-8, which the Hub cannot store; "
                              "rename it (in the checkpoint's huggingface/ folder too) and push again") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{folder}/{shown}: a symbolic link; the Hub push takes regular files only: replace "
                              "the link by a copy of the file, or remove it, and push again")
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise CheckpointError(f"{folder}/{shown}: not a regular file (a device, socket or pipe); remove it and push "
                              "again")


def _publish(api, repo_id: str, branch: str, folder: Path, files: list[str], message: str, tag: str | None,
             tagged: str | None, hashed: dict[Path, str]) -> tuple[str, bool]:
    """Make the branch hold exactly `files` in ONE commit; (commit, whether one was made). Against the branch's
    head as read here (`parent_commit`: a branch moved meanwhile fails the commit, nothing half-applied)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.hf_api import RepoFile

    head = _head(api, repo_id, branch)
    remote = {e.path: e for e in api.list_repo_tree(repo_id, revision=head, recursive=True) if isinstance(e, RepoFile)}
    stale = sorted(set(remote) - set(files) - {".gitattributes"})  # the Hub's own .gitattributes stays
    changed = [path for path in files if not _same_content(folder / path, remote.get(path), hashed)]
    if tagged and (tagged != head or changed or stale):
        raise _tag_elsewhere(repo_id, tag, tagged)  # the commit about to be made cannot be the tagged one
    if not changed and not stale:
        return head, False
    additions = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(folder / path)) for path in changed]
    for addition in additions:  # hashed already: the client (LFS or Xet) need not read the file for it again
        if folder / addition.path_in_repo in hashed:
            addition.upload_info.sha256 = bytes.fromhex(hashed[folder / addition.path_in_repo])
    api.preupload_lfs_files(repo_id, additions=additions, revision=branch)  # Xet or LFS: content first, no commit
    operations = [CommitOperationDelete(path_in_repo=path) for path in stale] + additions
    info = api.create_commit(repo_id, operations=operations, revision=branch, parent_commit=head,
                             commit_message=message)
    return info.oid, info.oid != head


def _same_content(path: Path, remote, hashed: dict[Path, str]) -> bool:
    """Whether the Hub's file `remote` (a RepoFile, or None) holds the bytes of `path`: sha256 for LFS files (kept
    in `hashed`), the git blob id for regular ones (what the Hub reports for each)."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    if remote is None or remote.size != path.stat().st_size:
        return False
    if remote.lfs:
        if path not in hashed:
            with open(path, "rb") as f:
                hashed[path] = sha_fileobj(f).hex()
        return hashed[path] == remote.lfs.sha256
    return git_hash(path.read_bytes()) == remote.blob_id  # a regular file is small (the Hub keeps large ones in LFS)


def _tag_target(api, repo_id: str, tag: str) -> str | None:
    """The commit `tag` points at, None when there is no such tag."""
    return next((ref.target_commit for ref in api.list_repo_refs(repo_id).tags if ref.name == tag), None)


def _tag(api, retried, repo_id: str, tag: str, commit: str, tagged: str | None) -> None:
    """Point `tag` at `commit` (kept when it already does), then read it back: a tag reported is a tag that holds."""
    if tagged is None:
        retried(lambda: api.create_tag(repo_id, tag=tag, revision=commit, exist_ok=True))
    now = retried(lambda: _tag_target(api, repo_id, tag))
    if now != commit:
        raise _tag_elsewhere(repo_id, tag, now, pushed=commit)


def _tag_elsewhere(repo_id: str, tag: str, target: str | None, pushed: str | None = None) -> CheckpointError:
    where = f"points at commit {target}" if target else "is missing after it was created"
    done = f" (branch pushed as {pushed}, tag not moved)" if pushed else " (nothing pushed)"
    return CheckpointError(f"Hub tag {tag} of {repo_id} {where}, not at the commit this push publishes{done}; choose "
                           f"another --tag, or delete the tag on the Hub (hf repo tag delete {repo_id} {tag}) and push "
                           "again")


# Requests huggingface_hub sends once (no retry of its own): create repo, branch, tag, refs, the commit, repo info.
_UNRETRIED_BY_CLIENT = re.compile(
    r"/api/repos/create$|/(?:branch|tag|commit)/[^/]+$|/refs$|^/api/(?:models|datasets|spaces)/[^/]+/[^/]+(?:/revision/[^/]+)?$")
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
