"""Errors the engine raises on purpose. Each carries a message meant for the user, in one line."""


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


class OutputPathError(GaplessError):
    """A file the user asked to have written cannot be written there (a folder, a device, no such folder)."""


def one_line(what: object, limit: int = 240) -> str:
    """An exception's message (its type's name where it has none) or any text, on one line and at most `limit`
    characters: how a message reaches a status line, a log line or a JSON field."""
    text = " ".join(str(what).split())
    if not text and isinstance(what, BaseException):
        text = type(what).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
