"""One retry policy for everything that talks to a remote service (object storage, the Hub), and the numeric
settings read from the environment (`env_number`, `lock_timeout`).

>>> Retries(retries=2, backoff_s=0.5).delay(1)
1.0
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CheckpointError

T = TypeVar("T")


def env_number(name: str, default, kind):
    """A finite, non-negative number from the environment variable `name` (unset or empty: `default`); anything
    else (`nan`, `inf`, `-5`, `ten`) is a one-line CheckpointError naming the variable.

    >>> os.environ["CKPTFLOW_EXAMPLE_S"] = "nan"
    >>> try:
    ...     env_number("CKPTFLOW_EXAMPLE_S", 1.0, float)
    ... finally:
    ...     del os.environ["CKPTFLOW_EXAMPLE_S"]
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: CKPTFLOW_EXAMPLE_S='nan': not a finite, non-negative float; fix or unset it
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if not 0 <= value < math.inf:  # False for NaN too
        raise CheckpointError(f"{name}={text!r}: not a finite, non-negative {kind.__name__}; fix or unset it")
    return value


@dataclass(frozen=True)
class Retries:
    """`retries` more tries after the first, waiting `backoff_s`, then twice as long each time."""

    retries: int
    backoff_s: float

    @classmethod
    def from_env(cls, prefix: str, retries: int, backoff_s: float) -> Retries:
        """From `{prefix}_RETRIES` and `{prefix}_BACKOFF`, with these defaults."""
        return cls(env_number(f"{prefix}_RETRIES", retries, int), env_number(f"{prefix}_BACKOFF", backoff_s, float))

    def delay(self, attempt: int) -> float:
        return self.backoff_s * 2 ** attempt

    def call(self, action: Callable[[], T], wait_after: Callable[[Exception, int], float | None]) -> T:
        """`action()`, tried again while `wait_after(error, attempt)` names seconds to wait (None: give up
        at once); the last error is raised when the budget is spent."""
        for attempt in range(self.retries + 1):
            try:
                return action()
            except Exception as error:
                wait = wait_after(error, attempt)
                if wait is None or attempt == self.retries:
                    raise
                time.sleep(wait)
        raise AssertionError("unreachable")


# Read here beside the other settings from the environment, so the request (which sits below the targets) can check
# the value a target's writer will wait by when it is built.
DEFAULT_LOCK_TIMEOUT_S = 3600.0


def lock_timeout() -> float:
    """Seconds a writer waits for another writer of the same target (`CKPTFLOW_LOCK_TIMEOUT`, finite, >= 0)."""
    return env_number("CKPTFLOW_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT_S, float)
