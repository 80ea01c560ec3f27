"""Publishing to the Hugging Face Hub."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore.hub import CARD_FILE, model_card, push_folder


def hub_token(secret_block: str | None) -> str | None:
    """A token from a Prefect Secret block when one is named; else huggingface_hub's own lookup (HF_TOKEN)."""
    if not secret_block:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(secret_block).get()


@task(name="push_to_hub", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def push_to_hub(target: str, manifest: dict, checks: list[dict], repo_id: str, revision: str | None = None,
                private: bool = True, tag: str | None = None, token_secret: str | None = None) -> dict:
    """Write the model card, push the folder to `repo_id`@`revision`, and check the remote equals it."""
    folder = Path(target)
    config = json.loads((folder / "config.json").read_text())
    (folder / CARD_FILE).write_text(model_card(manifest, config, checks))
    return push_folder(folder, repo_id, revision=revision, private=private, tag=tag, token=hub_token(token_secret))
