"""Prefect's log lines about a failed flow or task run, without a traceback when the error is ours.

Prefect logs every exception that ends a run with its traceback (`logger.exception`), on the console and to the
server. A `CheckpointError` (bad input: a missing file, a bad option) or `VerificationError` (a failed proof) is
not a bug: its message says what is wrong and how to fix it, in one line, and a traceback under it only buries that
line. The filter keeps Prefect's line, which names the error, and drops the traceback; any other exception keeps it.
Installed when `ckptflow.flows` is imported, so every process that runs our flows (the CLI, a worker's flow-run
process, a Dask worker) has it.

>>> import logging
>>> record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None,
...                            (CheckpointError, CheckpointError("bad"), None))
>>> OneLineForOurErrors().filter(record), record.exc_info
(True, None)
"""

from __future__ import annotations

import logging

from mergecore.errors import CheckpointError, VerificationError

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where Prefect's engines report a run's exception


class OneLineForOurErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (CheckpointError, VerificationError)):
            record.exc_info = record.exc_text = None
        return True


def install() -> None:
    """Add the filter to Prefect's run loggers (once; Prefect's own logging set-up keeps a logger's filters)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineForOurErrors) for f in logger.filters):
            logger.addFilter(OneLineForOurErrors())
