"""Promotion on `checkpoint.uploaded` events, inside a boundary set by whoever deploys it.

The deployment fixes where checkpoints may come from, a target root and a Hub organisation (`ckptflow deploy
--checkpoint-root SRC --target-root ROOT --hub-org ORG`), and which Hub branches events may name (only the derived
`step-N` unless `--revision-pattern REGEX`; never `refs/...`). An event names a checkpoint and may suggest step,
run, target, Hub repo and branch; whatever it leaves out is derived (`flows.events.promotion_place`), and whatever
it names must stay inside those bounds. So anyone who can post events can ask for a promotion of a checkpoint
below the source root, but not choose where it lands nor replace `main`.

>>> event_place("s3://ckpts/run1/global_step_7/actor", "/models", "acme")
{'target': '/models/run1/step-7', 'hub_repo': 'acme/run1', 'revision': 'step-7'}
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlsplit

from prefect import flow
from prefect.states import Completed

from mergecore import CheckpointError
from mergecore.hub import check_repo_id

from .events import UploadedCheckpoint, promotion_place, step_and_run, step_branch
from .promote import promote_checkpoint
from .requests import PromotionSettings
from .settings import in_process_settings

_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


def is_local(location: str) -> bool:
    return "://" not in location or location.startswith("file://")


def below(path: str, root: str) -> str | None:
    """`path` resolved (a relative one under `root`) if it is `root` or lies below it, else None.

    Local paths are compared after resolving `..` and symlinks, so a link inside the root that points out of it
    does not pass; URLs after normalising their path, and only within the root's scheme and bucket/host.

    >>> below("run1/step-7", "/models"), below("/models/../etc", "/models")
    ('/models/run1/step-7', None)
    """
    if is_local(root):
        if not is_local(path):
            return None
        local_root = _real(root.removeprefix("file://"))
        resolved = _real(os.path.join(local_root, path.removeprefix("file://")))
        return resolved if os.path.commonpath([local_root, resolved]) == local_root else None
    root_url = urlsplit(root)
    if is_local(path) and path.startswith(("/", "file://")):
        return None
    root_path = posixpath.normpath("/" + root_url.path.lstrip("/"))
    given = urlsplit(path if "://" in path else f"{root.rstrip('/')}/{path}")
    resolved = posixpath.normpath("/" + given.path.lstrip("/"))
    same_store = (given.scheme, given.netloc) == (root_url.scheme, root_url.netloc)
    if not same_store or not (resolved == root_path or resolved.startswith(root_path.rstrip("/") + "/")):
        return None
    return f"{root_url.scheme}://{root_url.netloc}{resolved}"


def _real(path: str) -> str:
    """`path` with links and `..` resolved; one that cannot resolve (a link loop, a name too long) is refused."""
    try:
        return os.path.realpath(path, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        return os.path.realpath(path)  # not there (yet): what it would resolve to
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be resolved ({error.strerror}); name a real folder") from None


def inside_root(target: str, target_root: str) -> str:
    """`target` resolved (a relative one under the root), if it lies strictly below `target_root` (see `below`).

    >>> inside_root("run1/step-7", "/models")
    '/models/run1/step-7'
    """
    resolved = below(target, target_root)
    if resolved is None or resolved == below(target_root, target_root):
        raise _outside(target, target_root)
    return resolved


def _outside(target: str, target_root: str) -> CheckpointError:
    return CheckpointError(f"target {target!r} is outside this deployment's target root {target_root}; "
                           "leave the target out of the event (it is derived) or name a folder below the root")


def inside_checkpoint_root(checkpoint: str, checkpoint_root: str | None) -> str:
    """The event's checkpoint resolved, if it is inside the deployment's source boundary (see `below`); the
    promotion reads the resolved path, so a link swapped in later is not followed out of the root.

    >>> inside_checkpoint_root("s3://ckpts/run1/global_step_7/actor", "s3://ckpts")
    's3://ckpts/run1/global_step_7/actor'
    """
    if not checkpoint_root:
        raise CheckpointError("this deployment has no checkpoint root; apply it with `ckptflow deploy "
                              "--checkpoint-root PATH_OR_URL` so events can only name checkpoints below it")
    resolved = below(checkpoint, checkpoint_root)
    if resolved is None:
        raise CheckpointError(f"checkpoint {checkpoint!r} is outside this deployment's checkpoint root "
                              f"{checkpoint_root}; announce a checkpoint below it, or deploy with another "
                              "--checkpoint-root")
    return resolved


def allowed_revision(revision: str | None, step: int | None, revision_pattern: str | None = None) -> str:
    """The Hub branch an event may push to: the derived `step-N` (`latest` without a step), or, when the event
    names another, one that fully matches the deployment's `revision_pattern`. Never a `refs/...` name (the
    Hub reads `refs/heads/main` as main and `refs/pr/N` as a pull request), whatever the pattern.

    >>> allowed_revision(None, 7), allowed_revision("rc-1", 7, r"rc-\\d+")
    ('step-7', 'rc-1')
    """
    derived = step_branch(step)
    if revision is None or revision == derived:
        return derived
    if revision.startswith("refs/") or not _BRANCH.fullmatch(revision) or ".." in revision:
        raise CheckpointError(f"revision {revision!r} is not a branch name; use letters, digits, '.', '_', '-' or "
                              "'/' (never refs/...), or leave revision out of the event")
    if revision_pattern and re.fullmatch(revision_pattern, revision):
        return revision
    allowed = f"{derived} or a branch matching '{revision_pattern}'" if revision_pattern else f"only {derived}"
    raise CheckpointError(f"revision {revision!r} refused: this deployment lets events push to {allowed}; leave "
                          "revision out of the event, or deploy with --revision-pattern REGEX")


def inside_org(hub_repo: str, hub_org: str | None) -> str:
    """`hub_repo` if it is `{hub_org}/{name}`; a deployment without an organisation pushes nowhere."""
    if not hub_org:
        raise CheckpointError(f"Hub repo {hub_repo!r} refused: this deployment has no Hub organisation "
                              "(ckptflow deploy --hub-org ORG); leave hub_repo out of the event")
    org, _, name = str(hub_repo).partition("/")
    if org != hub_org or not name or "/" in name:
        raise CheckpointError(f"Hub repo {hub_repo!r} is outside this deployment's Hub organisation {hub_org}; "
                              f"leave hub_repo out of the event or name {hub_org}/NAME")
    return check_repo_id(hub_repo, "hub_repo")


def event_place(checkpoint: str, target_root: str | None, hub_org: str | None = None, step: int | None = None,
                run: str | None = None, target: str | None = None, hub_repo: str | None = None,
                revision: str | None = None, revision_pattern: str | None = None) -> dict:
    """Where the promotion an event asks for lands: the event's own choices checked against the boundary,
    the rest derived from the checkpoint path (step, run) by `promotion_place`."""
    asked = UploadedCheckpoint(checkpoint, step, run, target, hub_repo, revision)  # by type and form, first
    checkpoint, step, run, target, hub_repo, revision = (asked.checkpoint, asked.step, asked.run, asked.target,
                                                         asked.hub_repo, asked.revision)
    if not target_root:
        raise CheckpointError("this deployment has no target root; apply it with `ckptflow deploy --target-root "
                              "PATH` so events know where promotions may land")
    found_step, found_run = step_and_run(checkpoint)
    step = found_step if step is None else step
    run = run or found_run
    place = promotion_place(target_root, hub_org, run, step) if (target is None or hub_repo is None) else {}
    target = inside_root(target, target_root) if target is not None else inside_root(place["target"], target_root)
    hub_repo = inside_org(hub_repo, hub_org) if hub_repo is not None else place["hub_repo"]
    revision = allowed_revision(revision, step, revision_pattern) if hub_repo else None
    return {"target": target, "hub_repo": hub_repo, "revision": revision}


@flow(name="promote-uploaded")
def promote_uploaded(
    checkpoint: str,
    step: int | None = None,
    run: str | None = None,
    target: str | None = None,
    hub_repo: str | None = None,
    revision: str | None = None,
    target_root: str | None = None,
    hub_org: str | None = None,
    checkpoint_root: str | None = None,
    revision_pattern: str | None = None,
    event_id: str | None = None,
    settings: PromotionSettings = PromotionSettings(),
):
    """Promote the checkpoint an event announced, if it lies below the deployment's checkpoint root, inside its
    target root and Hub organisation, to the derived branch (or one its revision pattern allows).

    The parameters stay flat where the trigger's templates fill them (the event's checkpoint, step, run, target,
    hub_repo, revision, and `event_id`: the event that asked for this run, by which `ckptflow notify --wait` finds
    it) and where `ckptflow deploy` sets the boundary (target_root, hub_org, checkpoint_root, revision_pattern);
    how every promotion merges and pushes (dtype, quantize, ..., docs/quantization.md) is the deployment's
    `settings`. The final state's message says where the model is."""
    place = event_place(checkpoint, target_root, hub_org, step, run, target, hub_repo, revision, revision_pattern)
    source = inside_checkpoint_root(checkpoint, checkpoint_root)  # the event's fields were checked by event_place
    with in_process_settings():  # nested: no heartbeat thread of its own to join
        result = promote_checkpoint(settings.request(source, **place))
    return Completed(message=where_message(result), data=result)


def where_message(result: dict) -> str:
    """One line: the verified folder, and the Hub revision when there is one."""
    where = f"verified model: {result['target']}"
    if result.get("cached_groups"):
        where += f" ({len(result['cached_groups'])} groups reused from cache)"
    hub = result.get("hub")
    if hub:
        change = "new commit" if hub["new_commit"] else "unchanged, no new commit"
        where += f"; hub: {hub['url']} ({change} {hub['commit'][:12]})"
    return where
