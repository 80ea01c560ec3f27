"""Running the promotion flow from the command line, on the embedded default or a configured server."""

from __future__ import annotations

import os

from mergecore import CheckpointError, VerificationError


def run_promotion(**parameters) -> dict:
    """Run `promote_checkpoint` in this process and return its result.

    Without PREFECT_API_URL, Prefect starts its temporary local server. A failed run raises the
    task's own error (CheckpointError: bad input; VerificationError: not equal) so the CLI can
    print its one line and exit non-zero.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here
    from flows.promote import promote_checkpoint

    state = promote_checkpoint(**parameters, return_state=True)
    if state.is_completed():
        return state.result()
    raise first_error(state)


def first_error(state) -> Exception:
    """The exception that failed a run: ours when it is ours, else a one-line summary."""
    try:
        state.result()
    except (CheckpointError, VerificationError) as error:
        return error
    except Exception as error:  # noqa: BLE001 - anything else is reported, not swallowed
        found = _ours(error)
        return found or CheckpointError(f"promotion failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    return CheckpointError(f"promotion ended in state {state.name}: {state.message}")


def _ours(error: BaseException) -> Exception | None:
    seen = error
    while seen is not None:
        if isinstance(seen, (CheckpointError, VerificationError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
