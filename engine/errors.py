"""Errors the engine raises on purpose. Each carries a message meant for the user, in one line."""

from typing import Optional


class GaplessError(Exception):
    """Base of every error with a user-facing message."""


class OptionsError(GaplessError, ValueError):
    """An option or sampling parameter out of range."""


class ModelLoadError(GaplessError):
    """A model source that cannot be loaded: missing, corrupt, unsupported or unsafe."""


class UnsafeModelError(ModelLoadError):
    """A source that would need pickle or remote code to load. Refused before anything is executed."""


class FetchError(GaplessError):
    """The default-model download failed or was cancelled."""


class GenerationError(GaplessError):
    """A generation that could not run (e.g. an empty prompt)."""


class RemoteRefused(GenerationError):
    """A remote server answered a generation with an HTTP error: its status, its OpenAI error's `param` and `code`
    where it sent them, and its Retry-After, so a server relaying it can pass on what it means."""

    def __init__(
        self,
        message: str,
        status: int,
        param: Optional[str] = None,
        code: Optional[str] = None,
        retry_after: Optional[str] = None,
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after


class ReadStopped(Exception):
    """Raised from a progress hook to give up a model's read part way, because what it was for is no longer
    wanted (options chosen again, another model, the app closing). Not a GaplessError: nothing is wrong with the
    model, so no handler may report it as a fault of it."""


class OutputPathError(GaplessError):
    """A file the user asked to have written cannot be written there (a folder, a device, no such folder)."""


def one_line(what: object, limit: int = 240) -> str:
    """An exception's message (its type's name where it has none) or any text, on one line and at most `limit`
    characters: how a message reaches a status line, a log line or a JSON field."""
    text = " ".join(str(what).split())
    if not text and isinstance(what, BaseException):
        text = type(what).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
