"""Logging to a rotating file in the user log dir, and to stderr with --verbose."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _LogFile(logging.handlers.RotatingFileHandler):
    """The log file. A file name in a message that is not UTF-8 (Linux names are bytes; Python hands them over
    with surrogates standing in) is written with backslash escapes rather than losing the line; a file that
    cannot be written (a full disk) is said once, in one line, and logging to it stops, rather than a traceback
    on stderr for every line logged."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, maxBytes=2_000_000, backupCount=3, encoding="utf-8", errors="backslashreplace")

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        root = logging.getLogger()
        root.removeHandler(self)
        quiet = logging.NullHandler()  # else logging's last resort prints each warning on stderr
        quiet._gapless = True  # type: ignore[attr-defined]
        root.addHandler(quiet)
        if sys.stderr is not None:
            print(
                f"gapless: the log file {self.baseFilename} cannot be written ({exc}); nothing more is logged to it",
                file=sys.stderr,
            )


def early_logging() -> None:
    """Until setup_logging: a warning (a cache folder that cannot be made, as the folders are worked out) is one
    line on stderr like the app's others ("gapless: ..."), not logging's bare last resort."""
    root = logging.getLogger()
    if any(getattr(h, "_gapless", False) for h in root.handlers):
        return
    early = logging.StreamHandler()
    early.setLevel(logging.WARNING)
    early.setFormatter(logging.Formatter("gapless: %(message)s"))
    early._gapless = True  # type: ignore[attr-defined]  # replaced by setup_logging
    root.addHandler(early)


def setup_logging(log_file: Path, verbose: bool = False) -> None:
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for h in list(root.handlers):
        if getattr(h, "_gapless", False):
            root.removeHandler(h)
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fh = _LogFile(log_file)
    except OSError as exc:  # a read-only or full disk must not stop the app
        fh = None
        if sys.stderr is not None:  # said once, as the app's other lines are (before no handler is left to say it)
            print(f"gapless: cannot write the log file {log_file}: {exc.strerror or exc}", file=sys.stderr)
    if fh is not None:
        fh.setFormatter(logging.Formatter(FORMAT))
        fh._gapless = True  # type: ignore[attr-defined]
        root.addHandler(fh)
    if fh is None and not verbose:  # no log file: logging's last resort would print warnings and tracebacks
        nh = logging.NullHandler()
        nh._gapless = True  # type: ignore[attr-defined]
        root.addHandler(nh)
    if verbose:  # without --verbose, stderr carries only the one-line error messages of the CLI
        sh = logging.StreamHandler()
        sh.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        sh._gapless = True  # type: ignore[attr-defined]
        root.addHandler(sh)
    # httpx logs each request at INFO: a line for every remote answer and every read of a server's /metrics
    for noisy in ("urllib3", "httpx", "httpcore", "PIL", "matplotlib", "torch._dynamo", "torch._inductor"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
