"""Promotion on `checkpoint.uploaded` events, inside a boundary set by whoever deploys it.

The deployment fixes a target root and a Hub organisation (`ckptflow deploy --target-root ROOT --hub-org ORG`).
An event names a checkpoint and may suggest step, run, target, Hub repo and branch; whatever it leaves out is
derived (`flows.events.promotion_place`), and whatever it names must stay inside the root and the organisation.
So anyone who can post events can ask for a promotion, but not choose where it lands.

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

from .events import promotion_place, step_and_run
from .promote import promote_checkpoint

_REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


def is_local(location: str) -> bool:
    return "://" not in location or location.startswith("file://")


def inside_root(target: str, target_root: str) -> str:
    """`target` resolved (a relative one under the root), if it lies strictly below `target_root`.

    Local paths are compared after resolving `..` and symlinks, so a link inside the root that points out of it
    does not pass; URLs after normalising their path.

    >>> inside_root("run1/step-7", "/models")
    '/models/run1/step-7'
    """
    if is_local(target_root):
        if not is_local(target):
            raise _outside(target, target_root)
        root = os.path.realpath(target_root.removeprefix("file://"))
        resolved = os.path.realpath(os.path.join(root, target.removeprefix("file://")))
        if resolved == root or os.path.commonpath([root, resolved]) != root:
            raise _outside(target, target_root)
        return resolved
    root_url = urlsplit(target_root)
    if is_local(target) and target.startswith(("/", "file://")):
        raise _outside(target, target_root)
    root = posixpath.normpath("/" + root_url.path.lstrip("/"))
    given = urlsplit(target if "://" in target else f"{target_root.rstrip('/')}/{target}")
    path = posixpath.normpath("/" + given.path.lstrip("/"))
    if (given.scheme, given.netloc) != (root_url.scheme, root_url.netloc) or not path.startswith(root.rstrip("/") + "/"):
        raise _outside(target, target_root)
    return f"{root_url.scheme}://{root_url.netloc}{path}"


def _outside(target: str, target_root: str) -> CheckpointError:
    return CheckpointError(f"target {target!r} is outside this deployment's target root {target_root}; "
                           "leave the target out of the event (it is derived) or name a folder below the root")


def inside_org(hub_repo: str, hub_org: str | None) -> str:
    """`hub_repo` if it is `{hub_org}/{name}`; a deployment without an organisation pushes nowhere."""
    if not hub_org:
        raise CheckpointError(f"Hub repo {hub_repo!r} refused: this deployment has no Hub organisation "
                              "(ckptflow deploy --hub-org ORG); leave hub_repo out of the event")
    org, _, name = hub_repo.partition("/")
    if org != hub_org or not _REPO_NAME.fullmatch(name) or ".." in name:
        raise CheckpointError(f"Hub repo {hub_repo!r} is outside this deployment's Hub organisation {hub_org}; "
                              f"leave hub_repo out of the event or name {hub_org}/NAME")
    return hub_repo


def event_place(checkpoint: str, target_root: str | None, hub_org: str | None = None, step: int | None = None,
                run: str | None = None, target: str | None = None, hub_repo: str | None = None,
                revision: str | None = None) -> dict:
    """Where the promotion an event asks for lands: the event's own choices checked against the boundary,
    the rest derived from the checkpoint path (step, run) by `promotion_place`."""
    if not target_root:
        raise CheckpointError("this deployment has no target root; apply it with `ckptflow deploy --target-root "
                              "PATH` so events know where promotions may land")
    found_step, found_run = step_and_run(checkpoint)
    step = found_step if step is None else step
    run = run or found_run
    place = promotion_place(target_root, hub_org, run, step) if (target is None or hub_repo is None) else {}
    target = inside_root(target, target_root) if target is not None else inside_root(place["target"], target_root)
    if hub_repo is not None:
        hub_repo = inside_org(hub_repo, hub_org)
        revision = revision or (f"step-{step}" if step is not None else None)
    else:
        hub_repo, revision = place["hub_repo"], (revision or place["revision"]) if place["hub_repo"] else None
    if revision is not None and (not _BRANCH.fullmatch(revision) or ".." in revision):
        raise CheckpointError(f"revision {revision!r} is not a branch name; use letters, digits, '.', '_', '-' or '/'")
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
    event_id: str | None = None,
    dtype: str = "auto",
    private: bool = True,
    max_shard_size: str = "5GB",
    role: str = "actor",
    backend: str = "auto",
    hub_token_secret: str | None = None,
    on_nonfinite: str = "fail",
):
    """Promote the checkpoint an event announced, inside the deployment's target root and Hub organisation.

    `event_id` is the event that asked for this run (`ckptflow notify --wait` finds the run by it). The final
    state's message says where the model is."""
    place = event_place(checkpoint, target_root, hub_org, step, run, target, hub_repo, revision)
    result = promote_checkpoint(checkpoint=checkpoint, **place, dtype=dtype, private=private,
                                max_shard_size=max_shard_size, role=role, backend=backend,
                                hub_token_secret=hub_token_secret, on_nonfinite=on_nonfinite)
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
