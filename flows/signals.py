"""SIGTERM ends a CLI command the way Ctrl-C does: one line, cleanup run, exit 128 + signal number.

Kubernetes, Slurm and `timeout` stop a program with SIGTERM, whose default action kills Python on the spot:
no `finally`, no `except BaseException` (so the staging folder of a merge stays), no atexit (so Prefect's
temporary server, a uvicorn child process, is left running under init). Raising `Terminated` (a
KeyboardInterrupt) in the main thread instead unwinds the command like Ctrl-C; `stopped()` then says so in one
line and stops the temporary server itself.

During a flow run Prefect puts its own SIGTERM handler in place; when it fires, Prefect marks the run crashed,
puts the previous handler (ours) back and sends the signal again, so `Terminated` is raised all the same.

>>> message, code = stopped(Terminated(signal.SIGTERM))
>>> code, message
(143, 'interrupted by SIGTERM; stopped without publishing a partial model')
"""

from __future__ import annotations

import logging
import signal
import sys


class Terminated(KeyboardInterrupt):
    """SIGTERM received: unwinds the main thread like Ctrl-C, so every cleanup on the way runs."""


def raise_on_sigterm() -> None:
    """From now on the first SIGTERM raises `Terminated` in the main thread; later ones are ignored, so that a
    second signal cannot cut the cleanup the first one started (SIGKILL still ends the process)."""
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(signum)


def stopped(interruption: KeyboardInterrupt) -> tuple[str, int]:
    """(one-line message, exit code) for a command ended by SIGTERM (143) or Ctrl-C/SIGINT (130); the embedded
    Prefect server, if this process started one, is stopped first."""
    stop_embedded_prefect_server()
    number = signal.SIGTERM if isinstance(interruption, Terminated) else signal.SIGINT
    return f"interrupted by {number.name}; stopped without publishing a partial model", 128 + number


def quiet_from_now_on() -> None:
    """Nothing more from Prefect's loggers and log shipping in this process, which is about to exit: threads the
    signal did not stop (a task finishing its group) still log, and Prefect's services report, on stderr, the
    temporary server they can no longer reach. The command's one line must stay the last one printed."""
    logging.disable(logging.CRITICAL)
    logging.raiseExceptions = False  # Prefect's API log handler writes its failures to stderr unless this is off


def stop_embedded_prefect_server() -> None:
    """Stop every temporary Prefect server this process started (Prefect's `SubprocessASGIServer`, a uvicorn
    child). Prefect only stops it from atexit, which runs after every non-daemon thread has been joined, and
    not at all when the process is killed. Nothing to do, and nothing imported, when Prefect never started one."""
    server_module = sys.modules.get("prefect.server.api.server")
    servers = list(server_module.SubprocessASGIServer._instances.values()) if server_module else []
    if not servers:
        return
    _drain_prefect_services()
    for server in servers:
        server.stop()


def _drain_prefect_services(timeout_s: float = 10.0) -> None:
    """Send the logs and events Prefect still holds to the server while it is up (Prefect drains them at exit,
    before its atexit stop of the server; stopping the server first leaves them retrying a dead port)."""
    from prefect._internal.concurrency.services import QueueService

    QueueService.drain_all(timeout=timeout_s)
