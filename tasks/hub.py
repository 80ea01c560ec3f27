"""Publishing to the Hugging Face Hub."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore.hub import push_folder

from .merge import transient_io_error


def hub_token(secret_block: str | None) -> str | None:
    """A token from a Prefect Secret block when one is named; else huggingface_hub's own lookup (HF_TOKEN)."""
    if not secret_block:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(secret_block).get()


# push_folder already retries throttling and server errors; a push that still fails on the network is tried
# once more later. A refused token or a persistent Hub error (CheckpointError) fails at once.
@task(name="push_to_hub", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, retry_condition_fn=transient_io_error)
def push_to_hub(target: str, repo_id: str, revision: str | None = None, private: bool = True, tag: str | None = None,
                token_secret: str | None = None) -> dict:
    """Push the published folder (card and manifest included, as verified) to `repo_id`@`revision`, and check
    the remote equals it."""
    return push_folder(target, repo_id, revision=revision, private=private, tag=tag, token=hub_token(token_secret))
