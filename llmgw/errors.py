"""The root of every error llmgw raises for a person to read.

An `LlmgwError` says what is wrong and what to do about it; the CLI prints its message and
exits non-zero. Any other exception is a bug and surfaces as one, with its traceback (as
httpx has `HTTPError` under which all of its own errors live).
"""

from __future__ import annotations


class LlmgwError(Exception):
    """A problem stated for the operator: the thing, what is wrong with it, and the fix."""


def stated(exc: BaseException) -> LlmgwError | None:
    """The problem stated for a person that ended a command, also from inside a task group's
    ExceptionGroup; None when it was anything else (a bug: it keeps its traceback)."""
    if isinstance(exc, LlmgwError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        ours, rest = exc.split(LlmgwError)
        if ours is not None and rest is None:
            return stated(ours.exceptions[0])
    return None
