"""The base class of errors caused by the user's input or environment (bad config, missing files, bad addresses).

The CLI prints such an error as one ``error: ...`` line and exits with status 2; anything else is a bug and
keeps its traceback.
"""


class UserError(RuntimeError):
    """An error whose message is one line meant for the user."""


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (its type name when the message is empty)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
