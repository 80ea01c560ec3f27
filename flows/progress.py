"""The merge's progress artifact, kept up to date without holding the merge up."""

from __future__ import annotations

import contextvars
import logging
import threading

from prefect.artifacts import create_progress_artifact, update_progress_artifact


class GroupProgress:
    """A progress artifact for `total` groups; `advance()` returns at once.

    Each API call takes tens of milliseconds, as long as a cached group. A background thread sends
    the latest figure, one request at a time: when groups finish faster than the server answers
    (a rerun), figures in between are skipped. `close()` waits until the last figure is sent.

        with GroupProgress(12, "groups merged into out/") as progress:
            for finished in ...:
                progress.advance()
    """

    def __init__(self, total: int, description: str):
        self.total, self.description = total, description
        self._done = 0
        self._sent: int | None = None
        self._closed = False
        self._changed = threading.Condition()
        run_in_this_flow = contextvars.copy_context().run  # the artifact belongs to the calling flow run
        self._thread = threading.Thread(target=run_in_this_flow, args=(self._send_until_closed,),
                                        name="progress-artifact", daemon=True)
        self._thread.start()

    def advance(self) -> None:
        with self._changed:
            self._done += 1
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def __enter__(self) -> GroupProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send_until_closed(self) -> None:
        try:
            artifact = create_progress_artifact(0.0, description=self.description)
            self._sent = 0
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._done != self._sent or self._closed)
                    done, closing = self._done, self._closed
                if done != self._sent:
                    update_progress_artifact(artifact, 100.0 * done / max(self.total, 1))
                    self._sent = done
                elif closing:
                    return
        except Exception as error:  # noqa: BLE001 - a lost progress figure must not fail the merge
            logging.getLogger("ckptflow").warning("progress artifact not updated: %s", error)
