"""Prefect settings for flows run in this process (`in_process_settings`), and the one line for a temporary
server that never answered."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

from mergecore import CheckpointError


# The temporary server must answer within this many seconds; Prefect's 20 s is missed on a busy machine
# (two promotes at once on 2 cores). Only a default: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (env or
# profile) wins.
EPHEMERAL_STARTUP_TIMEOUT_S = 180
_SERVER_TIMED_OUT = "Timed out while attempting to connect to ephemeral Prefect API server"


@contextmanager
def in_process_settings():
    """Prefect settings for flows run in this process: by the CLI, tests and benchmarks, and every nested flow
    (a deployment's run calls its subflows under it).

    Flow-run heartbeats let a server spot crashed runs, but only with an automation watching for
    them, and Prefect 3.9 joins the heartbeat thread at the end of every flow run (up to 1 s each: it
    sleeps in whole seconds). So they are off unless PREFECT_FLOWS_HEARTBEAT_FREQUENCY is set (env or
    profile): the setting of someone who wants a killed CLI run marked Crashed. A deployment's run keeps its
    own heartbeat (the engine starts it before the flow's code runs); its nested flows, in the same process,
    would only add their joins. The temporary server gets EPHEMERAL_STARTUP_TIMEOUT_S to start unless
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is set, and when it still does not answer that is one
    line (CheckpointError), not a traceback.
    Building a Settings object costs ~50 ms, so the adjusted copy is made once per current settings.

    >>> with in_process_settings():
    ...     from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as timeout
    ...     timeout.value() >= 20
    True
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here
    from prefect.context import SettingsContext, get_settings_context

    current = get_settings_context()
    key = id(current.settings)  # the entry keeps that object alive, so its id is not reused
    if key not in _ADJUSTED:
        if len(_ADJUSTED) > 8:
            _ADJUSTED.clear()
        updates = defaults_not_set(current.settings)
        _ADJUSTED[key] = (current.settings, current.settings.copy_with_update(updates=updates) if updates else None)
    adjusted = _ADJUSTED[key][1]
    with SettingsContext(profile=current.profile, settings=adjusted) if adjusted else nullcontext():
        try:
            yield
        except RuntimeError as error:
            if _SERVER_TIMED_OUT not in str(error):
                raise
            raise server_start_error() from None


def defaults_not_set(settings) -> dict:
    """Our defaults for the settings the user (env or profile) has not set."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    updates = {}
    if "heartbeat_frequency" not in settings.flows.model_fields_set:
        updates[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
    if "startup_timeout_seconds" not in settings.server.ephemeral.model_fields_set:
        updates[PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = EPHEMERAL_STARTUP_TIMEOUT_S
    return updates


def server_start_error() -> CheckpointError:
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    waited = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    return CheckpointError(
        f"the temporary Prefect server did not answer within {waited} s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); raise that setting on a busy machine, or run "
        "`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api")


_ADJUSTED: dict = {}  # id(settings in force) -> (those settings, the same with our defaults, or None: all set)
