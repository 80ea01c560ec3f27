"""Running the promotion flow from the command line, on the embedded default or a configured server."""

from __future__ import annotations

import os
from contextlib import contextmanager

from mergecore import CheckpointError, VerificationError


@contextmanager
def in_process_settings():
    """Prefect settings for flows run in this process (CLI, tests, benchmarks).

    Flow-run heartbeats let a server spot crashed runs, but only with an automation watching for
    them, and Prefect 3.9 joins the heartbeat thread at the end of every flow run (up to 1 s each).
    So they are off unless PREFECT_FLOWS_HEARTBEAT_FREQUENCY is set (env or profile): the setting
    of someone who wants a killed CLI run marked Crashed. Building a Settings object costs ~50 ms,
    so the quiet copy is made once per current settings.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    current = get_settings_context()
    if "heartbeat_frequency" in current.settings.flows.model_fields_set:
        yield
        return
    key = id(current.settings)  # the entry keeps that object alive, so its id is not reused
    if key not in _QUIET:
        if len(_QUIET) > 8:
            _QUIET.clear()
        quiet = current.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
        _QUIET[key] = (current.settings, quiet)
    with SettingsContext(profile=current.profile, settings=_QUIET[key][1]):
        yield


_QUIET: dict = {}  # id(settings in force) -> (those settings, the same without heartbeats)


def run_promotion(**parameters) -> dict:
    """Run `promote_checkpoint` in this process and return its result.

    Without PREFECT_API_URL, Prefect starts its temporary local server. A failed run raises the
    task's own error (CheckpointError: bad input; VerificationError: not equal) so the CLI can
    print its one line and exit non-zero.
    """
    from flows.promote import promote_checkpoint

    with in_process_settings():
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
