"""The user's Stop while a prompt is made, before any token exists: the chat template's render (a template that
loops) and the tokenizing of a long conversation (a 4 MB paste is tokenized several times while it is fitted to
the context: 44 s on two cores) give up at the next point that looks, rather than running on to their end.

`stopped_by(cancel)` names the event for the prompt made on this thread; `check()` raises PromptStopped once it
is set; engine.template_bounds stops a render in progress with it too.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

_STOP = threading.local()  # .event: what stops the prompt made on this thread (stopped_by)


class PromptStopped(Exception):
    """The prompt was given up because the user stopped the answer it was for. Not an error of the template or
    the conversation."""


@contextlib.contextmanager
def stopped_by(cancel: Optional[threading.Event]) -> Iterator[None]:
    """Within it, the prompt made on this thread stops, with PromptStopped, once `cancel` is set."""
    before = getattr(_STOP, "event", None)
    _STOP.event = cancel
    try:
        yield
    finally:
        _STOP.event = before


def current() -> Optional[threading.Event]:
    """The event that stops the prompt made on this thread, None outside stopped_by."""
    return getattr(_STOP, "event", None)


def check(doing: str) -> None:
    """PromptStopped ("stopped before `doing`") where this thread's prompt was stopped."""
    cancel = current()
    if cancel is not None and cancel.is_set():
        raise PromptStopped(f"stopped before {doing}")
