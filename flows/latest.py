"""`promote-latest`: on a schedule, promote the step each run's `latest_checkpointed_iteration.txt` names.

The ledger is the result itself: a step counts as promoted when its target (`promotion_place(...)["target"]`)
holds a ckptflow manifest and, with a Hub organisation, its Hub branch exists. Nothing else is remembered,
so a second run promotes nothing and deleting any local state (results folders, caches) loses nothing.
A target that is there without its branch is pushed again (its groups are not merged again).

Retention (`keep_last_n`) removes the oldest promoted folders `{target_root}/{run}/step-N` and Hub branches
`step-N` beyond the newest N; it never touches a run root (training checkpoints): a target root inside a run
root, or the other way round, is refused.

>>> promote_latest(["s3://ckpts/run1"], "/models", hub_org="acme", keep_last_n=3)   # doctest: +SKIP
{'run1': {'step': 1000, 'promoted': True, 'target': '/models/run1/step-1000', ...}}
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from prefect import flow, get_run_logger

from mergecore import CheckpointError
from mergecore.formats.completeness import TRACKER_FILE
from mergecore.model.manifest import MANIFEST_FILE
from mergecore.storage import Location

from .events import promotion_place
from .promote import promote_checkpoint
from .requests import PromotionSettings
from .settings import in_process_settings

_STEP_LEAF = re.compile(r"^step-(\d+)$")


def latest_step(run_root: Location) -> int:
    """The step verl's tracker file names (verl writes it after the step's files)."""
    tracker = run_root.join(TRACKER_FILE)
    try:
        return int(tracker.read_text().strip())
    except FileNotFoundError:
        raise CheckpointError(f"{tracker.url}: missing; configure the run root (the folder holding "
                              "global_step_N folders and this file written by verl)") from None
    except ValueError:
        raise CheckpointError(f"{tracker.url}: not a step number; fix or remove the file") from None


def hub_branches(repo_id: str, token: str | None = None) -> set[str]:
    """The branches of a Hub repo; none when the repo does not exist yet."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return {ref.name for ref in HfApi(token=token).list_repo_refs(repo_id).branches}
    except RepositoryNotFoundError:
        return set()


def is_promoted(place: dict, token: str | None = None) -> bool:
    """The ledger: the target holds a manifest and (with a Hub repo) the branch exists."""
    if not Location.of(place["target"]).join(MANIFEST_FILE).exists():
        return False
    return not place["hub_repo"] or place["revision"] in hub_branches(place["hub_repo"], token)


def check_apart(run_roots: list[str], target_root: str) -> None:
    """Retention deletes under the target root only: it may not overlap a run root."""
    target = Location.of(target_root).url.rstrip("/") + "/"
    for root in run_roots:
        run = Location.of(root).url.rstrip("/") + "/"
        if target.startswith(run) or run.startswith(target):
            raise CheckpointError(f"target root {target_root} overlaps the run root {root}: with keep_last_n it "
                                  "could delete training checkpoints; choose a target root outside every run root")


def prune(target_root: str, run: str, hub_repo: str | None, keep_last_n: int, token: str | None = None) -> dict:
    """Remove promoted `step-N` folders and Hub branches of `run` beyond the newest `keep_last_n`."""
    from huggingface_hub import HfApi

    folder = Path(target_root) / run
    local = sorted((int(m[1]), p) for p in (folder.iterdir() if folder.is_dir() else [])
                   if (m := _STEP_LEAF.match(p.name)) and (p / MANIFEST_FILE).is_file())
    removed = {"folders": [], "branches": []}
    for _, path in local[:-keep_last_n] if keep_last_n else local:
        shutil.rmtree(path)
        removed["folders"].append(str(path))
    if hub_repo:
        branches = sorted((int(m[1]), b) for b in hub_branches(hub_repo, token) if (m := _STEP_LEAF.match(b)))
        for _, branch in branches[:-keep_last_n] if keep_last_n else branches:
            HfApi(token=token).delete_branch(hub_repo, branch=branch)
            removed["branches"].append(branch)
    return removed


@flow(name="promote-latest")
def promote_latest(
    run_roots: list[str],
    target_root: str,
    hub_org: str | None = None,
    keep_last_n: int | None = None,
    settings: PromotionSettings = PromotionSettings(),
) -> dict:
    """For each run root, promote the step its tracker names unless it is already promoted; then apply
    retention. Returns {run: {step, promoted, target, hub_repo, revision, removed}}. `settings`: how every
    promotion merges and pushes (its `role` is also the folder read below global_step_N; `how.quantize`: every
    promotion published quantized)."""
    from ckptflow.tasks.hub import hub_token

    if keep_last_n is not None:
        if keep_last_n < 1:
            raise CheckpointError(f"keep_last_n={keep_last_n}: keep at least 1 (or None to keep every promotion)")
        check_apart(run_roots, target_root)
    logger = get_run_logger()
    token = hub_token(settings.hub_token_secret)
    report = {}
    for root in run_roots:
        run_root = Location.of(root)
        step = latest_step(run_root)
        place = promotion_place(target_root, hub_org, run_root.name, step)
        done = is_promoted(place, token)
        if done:
            logger.info("%s step %s: already promoted at %s", run_root.name, step, place["target"])
        else:
            with in_process_settings():  # nested: no heartbeat thread of its own to join
                promote_checkpoint(settings.request(run_root.join(f"global_step_{step}", settings.role).url, **place))
        removed = prune(target_root, run_root.name, place["hub_repo"], keep_last_n, token) if keep_last_n else {}
        report[run_root.name] = {"step": step, "promoted": not done, **place, "removed": removed}
    return report
