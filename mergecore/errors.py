"""Errors a user can act on: one line naming the file or tensor and the fix."""


class CheckpointError(Exception):
    """Bad input. The message is one line: what is wrong, where, and what to do.

    The CLI prints it as-is and exits with code 2; nothing is written to the target.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class VerificationError(CheckpointError):
    """The merged output does not equal its source or reference."""

    exit_code = 3


class EngineUnavailable(CheckpointError):
    """The serving engine cannot run this model here (not installed, no kernel for its head size, scheme or dtype
    on this machine): nothing was proven either way, which is neither a pass nor a failed check."""

    exit_code = 4
