"""Bounds on rendering a chat template. The template comes inside the model file, so it is not trusted: jinja2's
sandbox keeps it from reaching Python's internals, but not from looping for hours (two nested `range(100000)`),
recursing until the interpreter gives up, or asking for gigabytes (`'x' * 10**10`). Every render the engine does
(each answer, the context meter, the load's probe) goes through `bounded_render`:

- a deadline (TEMPLATE_SECONDS) and a memory bound (TEMPLATE_MEMORY: the process's resident memory may grow that
  much while it renders): one watch thread looks at every render in progress every WATCH_S seconds and stops one
  past a bound with an exception raised in its thread (CPython's PyThreadState_SetAsyncExc), which comes out as
  TemplateBoundError. A render costs nothing more while it runs (a trace function on the template's lines made
  a 200-message render 7x slower); a single operation that runs long inside C is stopped when it returns;
- anything else the template raises (RecursionError, MemoryError, a TypeError on a message's content) becomes a
  `jinja2.TemplateError` naming it, which the prompt reports as "the model's chat template failed: ...".

The operations that make a huge value in one step (a repeat `*`, a power `**`, a `%` or `.format` width, a text
method's or filter's width such as `center`) are checked before they run in the environment engine.fast_tokenizer
compiles templates in (`checked_operands`, `checked_arguments`, `checked_filters`); transformers' own renderer
(used for a model folder, and at a GGUF's first open) has the deadline, the memory bound and the error conversion.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import jinja2

from engine import prompt_stop
from engine.prompt_stop import PromptStopped

T = TypeVar("T")

TEMPLATE_SECONDS = 10.0  # chat templates render in milliseconds; a 200-message conversation in about one
TEMPLATE_MEMORY = 1 << 30  # bytes the resident memory may grow by during one render
TEMPLATE_ITEMS = 1 << 22  # the longest text, list or width one operation of a template may make (4,194,304)
TEMPLATE_INT_BITS = 4096  # the largest integer a power may make
WATCH_S = 0.02  # how often the watch thread looks at the renders in progress
STOPPED = "was stopped"  # a render's reason where the user stopped its prompt (engine.prompt_stop)


class TemplateBoundError(jinja2.TemplateError):
    """A chat template that ran past a bound (time, memory, size of a value)."""


class _Stopped(BaseException):
    """Raised by the watch thread in a render's thread; a BaseException, so that no `except Exception` in the
    template's runtime catches it on the way out."""


def bounded_render(render: Callable[[], T], seconds: float = TEMPLATE_SECONDS, memory: int = TEMPLATE_MEMORY) -> T:
    """render(), stopped with TemplateBoundError once it has run `seconds` or the resident memory has grown by
    `memory` bytes, and with PromptStopped where the user stopped the prompt (engine.prompt_stop); an exception
    other than a jinja2.TemplateError comes out as one, naming it. KeyboardInterrupt and SystemExit pass through."""
    prompt_stop.check("the chat template rendered the conversation")
    cancel = prompt_stop.current()
    watch = _Render(threading.get_ident(), time.monotonic() + seconds, seconds, _resident(), memory, cancel)
    try:
        _WATCH.add(watch)
        try:
            return _converted(render)
        finally:
            _WATCH.remove(watch)
    except _Stopped:
        if watch.reason == STOPPED:
            raise PromptStopped("stopped while the chat template rendered the conversation") from None
        raise TemplateBoundError(f"it {watch.reason}") from None


def _converted(render: Callable[[], T]) -> T:
    try:
        return render()
    except jinja2.TemplateError:
        raise
    except RecursionError:
        raise jinja2.TemplateError("it recursed too deeply") from None
    except MemoryError:
        raise jinja2.TemplateError("it ran out of memory") from None
    except Exception as exc:  # a template raises what it likes: TypeError, ValueError, ZeroDivisionError ...
        raise jinja2.TemplateError(f"{type(exc).__name__}: {exc}") from exc


@dataclass
class _Render:
    thread: int
    deadline: float
    seconds: float
    resident: Optional[int]  # at the start, None where the platform cannot tell
    memory: int
    cancel: Optional[threading.Event] = None
    reason: str = ""

    def past(self, now: float, resident: Optional[int]) -> str:
        if self.cancel is not None and self.cancel.is_set():
            return STOPPED
        if now > self.deadline:
            return f"took more than {self.seconds:g} s to render (a loop without end?)"
        if resident is not None and self.resident is not None and resident - self.resident > self.memory:
            return f"used more than {_size(self.memory)} of memory to render"
        return ""


class _Watch:
    """The thread that stops renders past their bounds; started at the first render, asleep while none runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._renders: dict[int, _Render] = {}
        self._thread: Optional[threading.Thread] = None

    def add(self, render: _Render) -> None:
        with self._cond:
            self._renders[id(render)] = render
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gapless-template-watch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, render: _Render) -> None:
        with self._cond:
            if self._renders.pop(id(render), None) is None and render.reason:
                _raise_in(render.thread, None)  # stopped as it finished: what was not yet raised is not raised

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._renders:
                    self._cond.wait()
                    continue
                self._cond.wait(WATCH_S)
                now, resident = time.monotonic(), _resident()
                for key, render in list(self._renders.items()):
                    render.reason = render.past(now, resident)
                    if render.reason:
                        del self._renders[key]
                        _raise_in(render.thread, _Stopped)


_WATCH = _Watch()


def _raise_in(thread: int, exc: Optional[type]) -> None:
    """Raises `exc` in `thread` at its next bytecode; None takes back one not yet raised."""
    api = getattr(ctypes, "pythonapi", None)
    if api is not None:  # CPython; elsewhere the render runs to its end
        api.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None if exc is None else ctypes.py_object(exc))


def _resident() -> Optional[int]:
    """The process's resident memory in bytes: /proc/self/statm on Linux, the peak (getrusage) on macOS, None
    elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"


# ---- the checks the sandboxed environment runs before an operation -------------------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NUMBER = re.compile(r"\d+")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


def checked_operands(op: str, left: Any, right: Any) -> None:
    """Raises TemplateBoundError where `left op right` would make a value past the bounds: a text or list
    repeated past TEMPLATE_ITEMS, a power past TEMPLATE_INT_BITS bits, a %-format with a width past
    TEMPLATE_ITEMS."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_ITEMS:
                raise TemplateBoundError(
                    f"it asked for a text or list of length {len(seq):,} repeated {n:,} times "
                    f"(more than {TEMPLATE_ITEMS:,})"
                )
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * max(abs(left).bit_length() - 1, 1) > TEMPLATE_INT_BITS:
                raise TemplateBoundError(f"it asked for {left} ** {right} (more than {TEMPLATE_INT_BITS:,} bits)")
    elif op == "%" and isinstance(left, str):
        widths = [int(w) for m in _PERCENT_SPEC.finditer(left) for w in m.groups() if w]
        args = right if isinstance(right, tuple) else (right,)
        widths += [a for a in args if isinstance(a, int) and not isinstance(a, bool)]  # '%*d' takes its width
        _check_widths(widths)


def checked_arguments(obj: Any, args: tuple, kwargs: dict) -> None:
    """Raises TemplateBoundError where a method of a text would make a value past TEMPLATE_ITEMS: an integer
    argument past it (`center`, `ljust`, `zfill`, `expandtabs` widths), or a format string whose field asks for a
    width past it (jinja2's sandbox hands `format` over wrapped: the text is the wrapped method's)."""
    method = getattr(obj, "__wrapped__", obj)
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if getattr(method, "__name__", None) in ("format", "format_map"):
        _check_widths([int(n) for spec in _FORMAT_SPEC.findall(text) for n in _NUMBER.findall(spec)])
        if _NESTED_SPEC.search(text):  # '{:>{}}': the width is an argument
            _check_widths(ints + [v for a in args if isinstance(a, dict) for v in a.values() if type(v) is int])
        return
    _check_widths(ints)


def _check_widths(widths: list[int]) -> None:
    for w in widths:
        if abs(w) > TEMPLATE_ITEMS:
            raise TemplateBoundError(f"it asked for a width or count of {w:,} (more than {TEMPLATE_ITEMS:,})")


WIDTH_FILTERS = ("center", "indent", "wordwrap")  # filters whose arguments size what they make


def checked_filters(filters: dict[str, Callable]) -> None:
    """Wraps, in place, the filters that make a text of a size their arguments give (WIDTH_FILTERS, and `format`
    with its %-widths) so that the size is checked first."""
    import functools

    def sized(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(value, *args, **kwargs):
            _check_widths([a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)])
            return f(value, *args, **kwargs)

        return wrapper

    def formatted(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(value, *args, **kwargs):
            checked_operands("%", value, args)
            return f(value, *args, **kwargs)

        return wrapper

    for name in WIDTH_FILTERS:
        if name in filters:
            filters[name] = sized(filters[name])
    if "format" in filters:
        filters["format"] = formatted(filters["format"])
