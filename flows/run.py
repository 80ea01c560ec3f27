"""Running the promotion flow from the command line, on the embedded default or a configured server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptflow.flows.settings import in_process_settings
from ckptflow.flows.signals import Terminated
from mergecore import CheckpointError, VerificationError

if TYPE_CHECKING:  # the annotation only: the flow's modules (Prefect, pydantic) load when a promotion runs
    from ckptflow.flows.requests import PromotionRequest


def run_promotion(request: PromotionRequest) -> dict:
    """Run `promote_checkpoint` on `request` in this process and return its result.

    The request was checked as it was built (flows/requests.py), so a bad value never starts Prefect. Without
    PREFECT_API_URL, Prefect starts its temporary local server. A failed run raises the task's own error
    (CheckpointError: bad input; VerificationError: not equal) so the CLI can print its one line and exit non-zero.
    """
    from ckptflow.flows.promote import promote_checkpoint

    with in_process_settings():
        state = promote_checkpoint(request, return_state=True)
    if state.is_completed():
        return state.result()
    raise first_error(state)


def first_error(state) -> BaseException:
    """The exception that failed a run: ours when it is ours, `Terminated` when a SIGTERM caused it, else a
    one-line summary."""
    try:
        state.result()
    except (CheckpointError, VerificationError) as error:
        return error
    except Exception as error:  # noqa: BLE001 - anything else is reported, not swallowed
        found = _ours(error) or _terminated(error)
        return found or CheckpointError(f"promotion failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    return CheckpointError(f"promotion ended in state {state.name}: {state.message}")


def _terminated(error: BaseException) -> Terminated | None:
    """`Terminated` when Prefect's SIGTERM exception is behind `error`. Prefect (3.9) raises it wherever the main
    thread is; caught while a task run is being created, it becomes "ValueError: Task run is not set" and the
    signal is lost: without this the CLI would report that error instead of the signal, and exit 2, not 143."""
    from prefect.exceptions import TerminationSignal

    seen = error
    while seen is not None:
        if isinstance(seen, TerminationSignal):
            return Terminated(seen.signal)
        seen = seen.__cause__ or seen.__context__
    return None


def _ours(error: BaseException) -> Exception | None:
    seen = error
    while seen is not None:
        if isinstance(seen, (CheckpointError, VerificationError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
